"""bench/persistent_layer.py's maths, stage by stage in the Triton interpreter, against its
float32 reference: the probe's GPU timings mean something only if it computes the decode layer."""
import math
import os

import pytest
import torch

# The interpreter is on where there is no GPU (tests/conftest.py). Setting it here instead would
# switch every Triton kernel decorated after this import to the interpreter, also on a GPU machine
# running tests/kernels as a whole; there these tests skip.
from bench.persistent_layer import PersistentLayer, reference_layer

# 6 q heads of 32 over 2 kv heads: hidden 192 = 3 chunks of 64; 20 programs, 12 of them for o and
# the last 8 for 2 kv heads x 4 splits of 16 cache rows (context 64); MLP: 200 act values (10 per
# program), down's k in 4 chunks of 64 (the last one masked)
HQ, HKV, D, HID, CONTEXT, S_MAX, INTER = 6, 2, 32, 192, 64, 80, 200


def layer_inputs(dtype, mlp: bool):
    torch.manual_seed(0)
    qkv_rows = (HQ + 2 * HKV) * D
    h = (torch.randn(HID) * 0.5).to(dtype)
    norm_w = 1 + 0.1 * torch.randn(HID)
    w = lambda *shape: (torch.randn(*shape) / math.sqrt(shape[-1])).to(dtype)  # noqa: E731
    inputs = dict(
        x=(h.float() * norm_w).to(dtype),                   # what the layer before emits: norm_w * h
        sumsq=(h.float() ** 2).reshape(4, -1).sum(1),        # ... and its sum of squares in 4 parts
        h=h, qkv_w=w(qkv_rows, HID), qkv_b=(0.1 * torch.randn(qkv_rows)).to(dtype), o_w=w(HID, HQ * D),
        emit_norm_w=(1 + 0.1 * torch.randn(HID)).to(dtype),
        k_cache=torch.randn(HKV, S_MAX, D).to(dtype), v_cache=torch.randn(HKV, S_MAX, D).to(dtype))
    angle = CONTEXT / 10000 ** (torch.arange(D // 2) * 2 / D)
    inputs["cos"] = torch.cat([angle.cos(), angle.cos()])[None]          # [1, D] "rotate half" rows
    inputs["sin"] = torch.cat([angle.sin(), angle.sin()])[None]
    inputs["mlp"] = (w(2 * INTER, HID), w(HID, INTER), (1 + 0.1 * torch.randn(HID)).to(dtype)) if mlp else None
    return inputs


@pytest.mark.parametrize("mlp, programs", [(False, None), (True, None), (True, 23)],
                         ids=["attention half", "whole layer", "whole layer, 3 programs for the MLP only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staged_layer_matches_reference(dtype, mlp, programs):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter (TRITON_INTERPRET=1)")
    i = layer_inputs(dtype, mlp)
    ref_k, ref_v = i["k_cache"].clone(), i["v_cache"].clone()
    want_h, want_weighted, want_sumsq = reference_layer(
        i["x"], i["sumsq"], i["h"], i["qkv_w"], i["qkv_b"], i["o_w"], i["emit_norm_w"], ref_k, ref_v, i["cos"],
        i["sin"], CONTEXT, num_heads=HQ, num_kv_heads=HKV, eps=1e-6, mlp=i["mlp"])

    counters = torch.zeros(HKV + 3, dtype=torch.int32)
    layer = PersistentLayer(i["qkv_w"], i["qkv_b"], i["o_w"], i["emit_norm_w"], i["k_cache"], i["v_cache"], counters,
                            num_heads=HQ, num_kv_heads=HKV, eps=1e-6, context=CONTEXT, mlp=i["mlp"],
                            programs=programs, split_t=16, kc=64, dkc=64, num_warps=4)
    assert layer.programs == (programs or 20) and layer.splits == 4
    got_h, got_weighted, got_sumsq = layer.run(i["x"], i["sumsq"], i["h"], i["cos"], i["sin"],
                                               torch.zeros(1, dtype=torch.int32),
                                               stages=(1, 2, 3, 4, 5) if mlp else (1, 2, 3))

    exact = dtype == torch.float32
    tol = dict(rtol=1e-4, atol=1e-5) if exact else dict(rtol=2e-2, atol=2e-2)
    context, h = CONTEXT, i["h"].float()
    torch.testing.assert_close(i["k_cache"][:, context].float(), ref_k[:, context].float(), **tol)
    torch.testing.assert_close(i["v_cache"][:, context].float(), ref_v[:, context].float(), **tol)
    torch.testing.assert_close(i["k_cache"][:, :context], ref_k[:, :context], rtol=0, atol=0)  # settled rows kept
    delta, want_delta = got_h.float() - h, want_h.float() - h
    assert (delta - want_delta).norm() / want_delta.norm() < (1e-4 if exact else 5e-2)
    if exact:
        torch.testing.assert_close(got_weighted.float(), want_weighted.float(), **tol)
    else:   # two rounded stages apart: a few elements are an ulp or two off, so the whole vector is compared
        assert (got_weighted.float() - want_weighted.float()).norm() / want_weighted.float().norm() < 5e-2
    torch.testing.assert_close(got_sumsq.sum(), want_sumsq, rtol=1e-5 if exact else 3e-2, atol=0)
    # the counters are the GPU path's: the staged interpreter path never touches them
    assert counters.eq(0).all()


@pytest.mark.parametrize("change, message", [(dict(context=48), "power-of-two count"),
                                             (dict(programs=19), "20 programs"),
                                             (dict(programs=21), "or more with mlp")])
def test_probe_refuses_what_it_cannot_run(change, message):
    i = layer_inputs(torch.float32, False)
    args = dict(num_heads=HQ, num_kv_heads=HKV, eps=1e-6, context=CONTEXT, split_t=16, kc=64) | change
    with pytest.raises(ValueError, match=message):
        PersistentLayer(i["qkv_w"], i["qkv_b"], i["o_w"], i["emit_norm_w"], i["k_cache"], i["v_cache"],
                        torch.zeros(HKV + 3, dtype=torch.int32), **args)
