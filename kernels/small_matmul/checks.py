"""Input checks shared by every few-row linear: small_linear's Triton and reference paths,
kernels.stream_linear and kernels.fused_mlp (a module of its own, so the stream kernel that
small_linear routes to imports the checks without importing small_linear)."""
from __future__ import annotations

import torch

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


def check_fusion_inputs(x, weight, bias, row_sumsq, residual, gated, emit_norm_weight) -> None:
    M, K = x.shape
    N = weight.shape[0] // 2 if gated else weight.shape[0]
    if gated:
        if weight.shape[0] % 2:
            raise ValueError(f"a gated weight stacks gate and up rows: [2N, K], got {list(weight.shape)}")
        if bias is not None:
            raise ValueError("a gated projection takes no bias")
    if row_sumsq is not None and (row_sumsq.dim() != 2 or row_sumsq.shape[1] != M or row_sumsq.dtype != torch.float32
                                  or not row_sumsq.is_contiguous() or row_sumsq.device != x.device):
        raise ValueError(f"row_sumsq must be a contiguous float32 [P, {M}] tensor on {x.device}, got "
                         f"{list(row_sumsq.shape)} {row_sumsq.dtype} on {row_sumsq.device}")
    if residual is not None and (residual.shape != (M, N) or residual.dtype != x.dtype
                                 or residual.stride(1) != 1 or residual.device != x.device):
        raise ValueError(f"residual must be a [{M}, {N}] {x.dtype} tensor with contiguous rows on {x.device}, "
                         f"got {list(residual.shape)} {residual.dtype} strides {residual.stride()}")
    if emit_norm_weight is not None:
        if residual is None:
            raise ValueError("emit_norm_weight needs residual: the emitted rows are the residual stream")
        if emit_norm_weight.shape != (N,) or emit_norm_weight.dtype != x.dtype or emit_norm_weight.stride(0) != 1:
            raise ValueError(f"emit_norm_weight must be a contiguous [{N}] {x.dtype} tensor, got "
                             f"{list(emit_norm_weight.shape)} {emit_norm_weight.dtype}")


__all__ = ["check_linear_inputs", "check_fusion_inputs", "MAX_ROWS", "DTYPES"]
