"""Batch-invariant linear for a few rows (decode and fused verification), bf16/f16/f32.

    out = small_linear(x, weight, bias)          # x [M, K], weight [N, K], bias [N] or None -> [M, N]

Guarantee (Triton backend): out[i] depends only on x[i], bitwise. It does not change with M (1..32)
or with the other rows or with where row i sits in the batch, so a token's logits are the same
whether the model runs on 1 token (decode) or on q + 1 (speculative verification). cuBLAS does not
promise this: it picks different kernels for different M, and the last bits of a row move with them.
The reference backend computes row by row in float32 and has the same property on its own device.
"""
from __future__ import annotations

import torch

from kernels._backend import resolve_backend
from kernels.small_matmul.reference import small_linear_reference

MAX_ROWS = 32
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_linear_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Raise ValueError naming the numbers when the shapes, dtypes, layouts or devices do not fit."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"expected x [M, K] and weight [N, K], got x {list(x.shape)}, weight {list(weight.shape)}")
    M, K = x.shape
    N, Kw = weight.shape
    if Kw != K:
        raise ValueError(f"x {list(x.shape)} and weight {list(weight.shape)} differ in K ({K} vs {Kw})")
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"x must hold 1..{MAX_ROWS} rows, got {M}")
    if N < 1 or K < 1:
        raise ValueError(f"weight must be non-empty, got {list(weight.shape)}")
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share one dtype of {DTYPES}, got {x.dtype} and {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(
            f"x and weight rows must be contiguous (stride 1 along K), got strides {x.stride()} and {weight.stride()}"
        )
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


def small_linear(
    x: torch.Tensor,                     # [M, K], M = 1..32, bf16/f16/f32, contiguous rows
    weight: torch.Tensor,                # [N, K] (nn.Linear layout), x's dtype, contiguous rows
    bias: torch.Tensor | None = None,    # [N], x's dtype
    *,
    backend: str = "auto",               # "auto" | "triton" | "reference"
) -> torch.Tensor:
    """x @ weight.T (+ bias) -> [M, N] in x's dtype, float32 accumulation, batch-invariant per row.

    backend "auto" runs Triton on CUDA and the reference elsewhere; "triton" also runs on CPU under
    TRITON_INTERPRET=1. The Triton path never syncs the host and can be captured in a CUDA graph.
    Tile sizes and k splits are fixed per (N, K, dtype) (kernels/small_matmul/triton_kernel.py).
    """
    check_linear_inputs(x, weight, bias)
    if resolve_backend(backend, x.device) == "reference":
        return small_linear_reference(x, weight, bias)
    from kernels.small_matmul.triton_kernel import small_linear_triton

    return small_linear_triton(x, weight, bias)


__all__ = ["small_linear", "small_linear_reference", "check_linear_inputs", "MAX_ROWS"]
