"""silu_mul: the Triton kernel against its float32 twin (bit for bit on CUDA) and eager `F.silu(gate) * up`."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchd.kernels.silu_mul import silu_mul, silu_mul_reference
from tests.kernels.conftest import DEVICE, REL_ERR, needs_triton, rel_err

LOW = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # the interpreter truncates bf16

SHAPES = [
    pytest.param((67, 1100), None, id="odd-rows-two-column-blocks"),       # 1,100 = 1,024 + a partial block
    pytest.param((2, 33, 300), None, id="batch-axis-partial-tile"),
    pytest.param((5, 96), (2, 64), id="small-tiles-partial-both-ways"),
]


def assert_twin(got, gate_up):
    """Bit for bit the twin on CUDA (libdevice's expf is eager's). The interpreter's numpy float32 exp
    and torch's CPU exp differ in the last bits for about a third of inputs, so there the bound is
    four units in the last place of the output dtype (the two exps up to two apart, carried through
    the division, and the product's rounding)."""
    expected = silu_mul_reference(gate_up)
    if DEVICE == "cuda":
        assert torch.equal(got, expected)
        return
    ulp = torch.finfo(got.dtype).eps * expected.double().abs().clamp_min(torch.finfo(got.dtype).tiny)
    assert ((got.double() - expected.double()).abs() <= 4 * ulp).all()


def make(shape, dtype, seed=0):
    *lead, width = shape
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*lead, 2 * width, generator=g) * 4).to(dtype).to(DEVICE)   # gate spans silu's bend


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, LOW], ids=["f32", "half"])
@pytest.mark.parametrize("shape, tile", SHAPES)
def test_triton_equals_twin_and_matches_eager(shape, tile, dtype):
    from batchd.kernels.silu_mul.triton_kernel import silu_mul_triton

    gate_up = make(shape, dtype)
    got = silu_mul(gate_up, backend="triton") if tile is None else silu_mul_triton(gate_up, *tile)
    assert got.shape == (*shape[:-1], shape[-1]) and got.dtype == dtype
    assert_twin(got, gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    assert rel_err(got, F.silu(gate) * up) < REL_ERR[dtype]


def test_twin_is_eager_silu_times_up():
    gate_up = make((9, 200), torch.float32)
    gate, up = gate_up.chunk(2, dim=-1)
    assert rel_err(silu_mul_reference(gate_up), F.silu(gate) * up) < 1e-6


@needs_triton
@pytest.mark.triton
def test_rows_do_not_depend_on_the_other_rows():
    gate_up = make((70, 130), LOW, seed=1)
    every = silu_mul(gate_up, backend="triton")
    for i in (0, 37, 69):
        assert torch.equal(silu_mul(gate_up[i : i + 1], backend="triton")[0], every[i])


def test_odd_width_names_the_shape():
    with pytest.raises(ValueError, match=r"\[3, 7\]"):
        silu_mul(torch.zeros(3, 7))
