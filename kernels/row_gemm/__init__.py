"""Batch-invariant linear for many rows (the batch engine's decode rows), bf16/f16/f32.

    out = row_linear(x, weight, bias)            # x [M, K], weight [N, K], bias [N] or None -> [M, N]

Row m of the result depends on x[m] and the weight only, for any M from 1 to a few thousand: the
tiles, warps, stages and program grouping are fixed per (N, K, dtype) by a table in
triton_kernel.py (never autotuned), K is walked in one order with no split, and M changes only the
grid. kernels.small_matmul does the same for up to 32 rows with decode fusions; this op is the plain
product for the batch engine, where a step's rows reach the hundreds and one weight read per step
should serve them all (engine.batch.rows, BatchOptions.decode_gemm).
"""
from __future__ import annotations

import torch

from batchd.kernels._backend import resolve_backend
from batchd.kernels.row_gemm.reference import row_linear_reference

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_row_linear_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Raise ValueError naming the numbers when the shapes, dtypes, layouts or devices do not fit."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"expected x [M, K] and weight [N, K], got x {list(x.shape)}, weight {list(weight.shape)}")
    M, K = x.shape
    N, Kw = weight.shape
    if Kw != K:
        raise ValueError(f"x {list(x.shape)} and weight {list(weight.shape)} differ in K ({K} vs {Kw})")
    if M < 1:
        raise ValueError(f"x must hold at least one row, got {list(x.shape)}")
    if N < 1 or K < 1:
        raise ValueError(f"weight must be non-empty, got {list(weight.shape)}")
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share one dtype of {DTYPES}, got {x.dtype} and {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"x and weight rows must be contiguous (stride 1 along K), got strides {x.stride()} "
                         f"and {weight.stride()}")
    if x.device != weight.device:
        raise ValueError(f"x and weight on different devices: {x.device}, {weight.device}")
    if bias is not None:
        if bias.shape != (N,):
            raise ValueError(f"bias must have shape [{N}], got {list(bias.shape)}")
        if bias.dtype != x.dtype:
            raise ValueError(f"bias must have x's dtype {x.dtype}, got {bias.dtype}")
        if bias.stride(0) != 1 and N > 1:
            raise ValueError(f"bias must be contiguous, got stride {bias.stride()}")
        if bias.device != x.device:
            raise ValueError(f"bias on {bias.device}, x on {x.device}")


def row_linear(
    x: torch.Tensor,                     # [M, K], M >= 1, bf16/f16/f32, stride 1 along K
    weight: torch.Tensor,                # [N, K] (nn.Linear layout), x's dtype, stride 1 along K
    bias: torch.Tensor | None = None,    # [N], x's dtype, contiguous
    *,
    backend: str = "auto",               # "auto" | "triton" | "reference"
) -> torch.Tensor:
    """x @ weight.T (+ bias) -> [M, N] in x's dtype, float32 accumulation; on the Triton path row m's
    bits depend only on x[m] and the weight (not on M, nor on the other rows).

    backend "auto" runs Triton on CUDA and the reference elsewhere; "triton" also runs on CPU under
    TRITON_INTERPRET=1. The Triton path never syncs the host and can be captured in a CUDA graph.
    """
    check_row_linear_inputs(x, weight, bias)
    if resolve_backend(backend, x.device) == "reference":
        return row_linear_reference(x, weight, bias)
    from batchd.kernels.row_gemm.triton_kernel import row_linear_triton

    return row_linear_triton(x, weight, bias)


__all__ = ["row_linear", "row_linear_reference", "check_row_linear_inputs", "DTYPES"]
