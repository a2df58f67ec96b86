"""Plain PyTorch twin of kernels.row_gemm: the values row_linear is tested against.

It defines the values, not the bits: a CPU BLAS may block the product by M, so this twin makes no
promise that a row's bits are independent of the rows beside it (the Triton kernel does).
"""
from __future__ import annotations

import torch


def row_linear_reference(
    x: torch.Tensor,                     # [M, K]
    weight: torch.Tensor,                # [N, K]
    bias: torch.Tensor | None = None,    # [N]
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """x @ weight.T (+ bias) in `compute_dtype`, the bias added before the one rounding -> [M, N] in x's dtype."""
    out = x.to(compute_dtype) @ weight.to(compute_dtype).T
    if bias is not None:
        out = out + bias.to(compute_dtype)
    return out.to(x.dtype)
