"""rms_norm: the Triton kernel against its twin, and each row independent of how many rows run."""
from __future__ import annotations

import pytest
import torch

from batchd.kernels.rms_norm import rms_norm, rms_norm_reference
from tests.kernels.conftest import DEVICE, needs_triton, rel_err

LOW = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # the interpreter truncates bf16


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, LOW], ids=["f32", "half"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "add"])
def test_triton_matches_reference_and_rows_are_invariant(dtype, residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 300, generator=g).to(dtype).to(DEVICE)
    res = torch.randn(7, 300, generator=g).to(dtype).to(DEVICE) if residual else None
    w = (torch.rand(300, generator=g) + 0.5).to(dtype).to(DEVICE)
    out, h = rms_norm(x, w, 1e-5, res, backend="triton")
    ref_out, ref_h = rms_norm_reference(x, w, 1e-5, res)
    assert rel_err(out, ref_out) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(h, ref_h) if residual else h is x
    for i in range(7):  # one row alone, as a decode step normalises it
        one, _ = rms_norm(x[i : i + 1], w, 1e-5, None if res is None else res[i : i + 1], backend="triton")
        assert torch.equal(one[0], out[i])


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, LOW], ids=["f32", "half"])
@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
def test_float32_form_matches_its_twin_and_rows_are_invariant(dtype, weighted):
    """DeepSeek V4's form: the weight product in float32 (a float32 weight on low-precision rows),
    one rounding to the asked dtype; a row alone gives the bits it gets among others."""
    from batchd.kernels.rms_norm import rms_norm_f32, rms_norm_f32_reference

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 300, generator=g).to(dtype).to(DEVICE)
    w = (torch.rand(300, generator=g) + 0.5).to(DEVICE) if weighted else None
    for out_dtype in (dtype, torch.float32):
        out = rms_norm_f32(x, w, 1e-6, out_dtype, backend="triton")
        assert out.dtype == out_dtype and out.shape == x.shape
        assert rel_err(out, rms_norm_f32_reference(x, w, 1e-6, out_dtype)) < (1e-6 if out_dtype == torch.float32 else 1e-2)
        assert torch.equal(rms_norm_f32(x[1, 3:4], w, 1e-6, out_dtype, backend="triton"), out[1, 3:4])
