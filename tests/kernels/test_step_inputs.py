"""kernels.step_inputs against its eager twin: the same positions, rope rows, embeddings and
first-norm inputs bit for bit, with the start on the host or on the device."""
from __future__ import annotations

import pytest
import torch

from batchd.kernels.small_matmul import norm_inputs
from batchd.kernels.step_inputs import step_inputs, step_inputs_reference
from tests.kernels.conftest import DEVICE, needs_triton


def tables(V=50, H=96, L=40, D=16, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(H + D)
    embed = torch.randn(V, H, generator=g).to(dtype).to(DEVICE)
    cos, sin = torch.randn(L, D, generator=g).to(DEVICE), torch.randn(L, D, generator=g).to(DEVICE)
    norm_weight = (1 + torch.randn(H, generator=g) / 4).to(dtype).to(DEVICE)
    return embed, cos, sin, norm_weight


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("B, T", [(1, 1), (1, 5), (2, 3)])
@pytest.mark.parametrize("on_device", [True, False], ids=["start-on-device", "start-on-host"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_matches_the_eager_ops_bit_for_bit(B, T, on_device, dtype):
    embed, cos, sin, norm_weight = tables(dtype=dtype)
    tokens = torch.randint(0, embed.shape[0], (B, T), generator=torch.Generator().manual_seed(T)).to(DEVICE)
    start = torch.tensor([7], device=DEVICE) if on_device else 7
    got = step_inputs(tokens, start, embed, cos, sin, norm_weight, backend="triton")
    want = step_inputs_reference(tokens, start, embed, cos, sin, norm_weight)
    assert got.positions.tolist() == list(range(7, 7 + T))
    assert (got.seq_len.tolist() == [7 + T]) if on_device else got.seq_len is None
    for name in ("positions", "cos", "sin", "hidden"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    # the first norm's inputs: exactly what norm_inputs' own kernel makes of the embeddings
    from_kernel = norm_inputs(want.hidden.view(B * T, -1), norm_weight, backend="triton")
    assert torch.equal(got.normed.weighted, from_kernel.weighted)
    assert torch.equal(got.normed.sumsq, from_kernel.sumsq)
    torch.testing.assert_close(got.normed.sumsq, want.normed.sumsq, rtol=1e-5, atol=0)


@needs_triton
@pytest.mark.triton
def test_without_a_norm_weight_no_norm_inputs():
    embed, cos, sin, _ = tables()
    tokens = torch.tensor([[3, 4]], device=DEVICE)
    got = step_inputs(tokens, torch.tensor([0], device=DEVICE), embed, cos, sin, backend="triton")
    assert got.normed is None and torch.equal(got.hidden, embed[tokens])


def test_bad_inputs_say_what_was_given():
    embed, cos, sin, norm_weight = tables()
    with pytest.raises(ValueError, match="int64"):
        step_inputs(torch.zeros(1, 2, dtype=torch.int32, device=DEVICE), 0, embed, cos, sin)
    with pytest.raises(ValueError, match="start on the device"):
        step_inputs(torch.zeros(1, 2, dtype=torch.long, device=DEVICE), torch.zeros(2, dtype=torch.long), embed,
                    cos, sin)
    with pytest.raises(ValueError, match="norm_weight"):
        step_inputs(torch.zeros(1, 2, dtype=torch.long, device=DEVICE), 0, embed, cos, sin, norm_weight[:5])
