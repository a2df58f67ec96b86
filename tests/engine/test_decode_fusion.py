"""The fused decode layer (norm+qkv, o+residual, norm+gate/up+silu*mul, down+residual: the path
CUDA decode and verify steps take; its MLP half as kernels.fused_mlp where down is stored
transposed, the engine's default on CUDA) computes the same model as the op-by-op path.

On the CPU kernels.small_matmul runs its reference twin, which implements the same fusions, so
forcing the fused path here checks the layer's wiring (which norm goes where, gate before up, the
residual stream) against transformers; the Triton kernel is held to that reference in
tests/kernels/test_small_matmul.py, and to eager CUDA steps in test_gpu_engine.py.
"""
from __future__ import annotations

import pytest
import torch

from batchd.engine import model as model_module
from batchd.engine.kv_cache import ContiguousKVCache
from tests.engine.tiny_models import hf_model, ours_from_hf

pytest.importorskip("transformers")


@pytest.mark.parametrize("mlp", ["chain", "fused"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fused_decode_layer_matches_transformers(arch, mlp, monkeypatch):
    hf = hf_model(arch)
    ours = ours_from_hf(hf)
    if mlp == "fused":  # down stored transposed: the MLP half through kernels.fused_mlp's twin
        assert ours.use_fused_mlp()
    tokens = torch.randint(0, 512, (1, 48), generator=torch.Generator().manual_seed(3))
    fused_calls = []

    def fused_for_small_steps(x, ops):
        fused_calls.append(x.shape[1])
        return x.shape[0] * x.shape[1] <= 16

    monkeypatch.setattr(model_module, "decode_fusion_applies", fused_for_small_steps)
    with torch.no_grad():
        expected = hf(tokens).logits
        cache = ContiguousKVCache(ours.config, 64, "cpu", torch.float32)
        chunks = [ours(tokens[:, :32], cache)]                          # prefill: op by op
        chunks += [ours(tokens[:, i : i + 1], cache) for i in range(32, 36)]  # decode: fused
        chunks.append(ours(tokens[:, 36:48], cache))                    # verify of 12 rows: fused
        got = torch.cat(chunks, dim=1)
    assert set(fused_calls) == {32, 1, 12}
    assert ((got - expected).norm() / expected.norm()).item() < 1e-4


def test_use_fused_mlp_stores_down_transposed_with_the_same_values():
    ours = ours_from_hf(hf_model("llama"))
    before = [layer.mlp.down_proj.weight.clone() for layer in ours.layers]
    assert ours.use_fused_mlp() and ours.use_fused_mlp()                 # idempotent
    for layer, weight in zip(ours.layers, before):
        down = layer.mlp.down_proj.weight
        assert down.shape == weight.shape and down.t().is_contiguous() and torch.equal(down, weight)
    assert not ours.use_fused_mlp(False)                                 # plain storage again
    assert all(layer.mlp.down_proj.weight.is_contiguous() for layer in ours.layers)
