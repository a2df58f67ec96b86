"""Batch-invariant linear for a few rows (decode and fused verification), bf16/f16/f32.

    out = small_linear(x, weight, bias)          # x [M, K], weight [N, K], bias [N] or None -> [M, N]

Decode-step fusions (each saves a launch per layer, which at batch 1 costs more than the bytes):
    small_linear(h, w_qkv, b, norm_weight=ln.weight, eps=ln.eps)   # RMSNorm(h) first
    small_linear(h, w_gate_up, norm_weight=..., gated=True)       # silu(x Wg^T) * (x Wu^T) -> [M, N/2]
    small_linear(a, w_o, residual=h)                                # h + a W^T

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


def check_fusion_inputs(x, weight, bias, norm_weight, residual, gated) -> None:
    M, K = x.shape
    N = weight.shape[0] // 2 if gated else weight.shape[0]
    if gated:
        if weight.shape[0] % 2:
            raise ValueError(f"a gated weight stacks gate and up rows: [2N, K], got {list(weight.shape)}")
        if bias is not None:
            raise ValueError("a gated projection takes no bias")
    if norm_weight is not None and (norm_weight.shape != (K,) or norm_weight.dtype != x.dtype
                                    or norm_weight.stride(0) != 1 or norm_weight.device != x.device):
        raise ValueError(f"norm_weight must be a contiguous [{K}] {x.dtype} tensor on {x.device}, got "
                         f"{list(norm_weight.shape)} {norm_weight.dtype} on {norm_weight.device}")
    if residual is not None and (residual.shape != (M, N) or residual.dtype != x.dtype
                                 or residual.stride(1) != 1 or residual.device != x.device):
        raise ValueError(f"residual must be a [{M}, {N}] {x.dtype} tensor with contiguous rows on {x.device}, "
                         f"got {list(residual.shape)} {residual.dtype} strides {residual.stride()}")


def small_linear(
    x: torch.Tensor,                     # [M, K], M = 1..32, bf16/f16/f32, contiguous rows
    weight: torch.Tensor,                # [N, K] (nn.Linear layout; [2N, K] gate then up when gated)
    bias: torch.Tensor | None = None,    # [N], x's dtype
    *,
    norm_weight: torch.Tensor | None = None,   # [K]: x goes through RMSNorm(norm_weight, eps) first
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,      # [M, N]: returned plus the product
    gated: bool = False,                       # silu(x Wg^T) * (x Wu^T) -> [M, N]
    backend: str = "auto",               # "auto" | "triton" | "reference"
) -> torch.Tensor:
    """x @ weight.T (+ bias) -> [M, N] in x's dtype, float32 accumulation, batch-invariant per row.

    backend "auto" runs Triton on CUDA and the reference elsewhere; "triton" also runs on CPU under
    TRITON_INTERPRET=1. The Triton path never syncs the host and can be captured in a CUDA graph.
    Tile sizes and k splits are fixed per (N, K, dtype) (kernels/small_matmul/triton_kernel.py).
    Rounding follows the unfused ops: normed x, the product, silu(gate) and up each in x's dtype.
    """
    check_linear_inputs(x, weight[: weight.shape[0] // 2] if gated else weight, bias)
    check_fusion_inputs(x, weight, bias, norm_weight, residual, gated)
    if resolve_backend(backend, x.device) == "reference":
        return small_linear_reference(x, weight, bias, norm_weight=norm_weight, eps=eps, residual=residual,
                                      gated=gated)
    from kernels.small_matmul.triton_kernel import small_linear_triton

    return small_linear_triton(x, weight, bias, norm_weight=norm_weight, eps=eps, residual=residual, gated=gated)


__all__ = ["small_linear", "check_fusion_inputs", "small_linear_reference", "check_linear_inputs", "MAX_ROWS"]
