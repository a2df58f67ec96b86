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
from batchd.kernels.small_matmul.checks import DTYPES, check_linear_inputs


def check_row_linear_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Raise ValueError naming the numbers when the shapes, dtypes, layouts or devices do not fit."""
    check_linear_inputs(x, weight, bias, max_rows=None)


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
