"""Plain PyTorch twin of the batch-invariant small-M linear (the definition the kernel is tested against).

Each row is computed on its own, in float32, so row i of the result depends on x[i] alone.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class NormInputs(NamedTuple):
    """What a projection with an RMSNorm folded in needs of the rows h it normalises:
    weighted = norm_weight * h in h's dtype [M, K] (the projection's x), sumsq = the rows' sums of
    squares of h in float32, in parts to be added in order [P, M] (P depends on who wrote it)."""
    weighted: torch.Tensor
    sumsq: torch.Tensor


def rms_scale(sumsq: torch.Tensor, K: int, eps: float) -> torch.Tensor:
    """[P, M] parts -> [M] float32 RMSNorm scale rsqrt(mean(h^2) + eps), parts added in order."""
    total = sumsq[0].clone()
    for part in sumsq[1:]:
        total += part
    return torch.rsqrt(total / K + eps)


def norm_inputs_reference(h: torch.Tensor, norm_weight: torch.Tensor) -> NormInputs:
    """h [M, K] -> NormInputs for RMSNorm(norm_weight), in one part."""
    h32 = h.float()
    return NormInputs((h32 * norm_weight.float()).to(h.dtype), h32.pow(2).sum(-1)[None, :])


def small_linear_reference(
    x: torch.Tensor,                     # [M, K]
    weight: torch.Tensor,                # [N, K] ([2N, K] gate then up when gated)
    bias: torch.Tensor | None = None,    # [N]
    compute_dtype: torch.dtype = torch.float32,
    *,
    row_sumsq: torch.Tensor | None = None,         # [P, M] float32
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,          # [M, N]
    gated: bool = False,
    emit_norm_weight: torch.Tensor | None = None,  # [N]
):
    """out[i] = weight @ x[i] (+ bias), one row at a time in `compute_dtype`. -> [M, N] in x's dtype.

    The fusions, in order: with row_sumsq, x holds norm_weight * h and the product is scaled by
    rms_scale(row_sumsq) before the bias (RMSNorm folded in: the scale is per row, so it can come
    after the sum); gated: silu(gate) * up with gate, up and silu(gate) rounded to x's dtype;
    residual[i] + out[i] with the product rounded first; emit_norm_weight: also the NormInputs of
    out for the norm that comes next, -> (out, NormInputs)."""
    dtype = x.dtype
    scale = None if row_sumsq is None else rms_scale(row_sumsq, x.shape[1], eps).to(compute_dtype)
    w = weight.to(compute_dtype)
    b = None if bias is None else bias.to(compute_dtype)
    n_out = weight.shape[0] // 2 if gated else weight.shape[0]
    out = torch.empty(x.shape[0], n_out, dtype=dtype, device=x.device)
    for i in range(x.shape[0]):
        row = w @ x[i].to(compute_dtype)
        if scale is not None:
            row = row * scale[i]
        if b is not None:
            row = row + b
        row = row.to(dtype)
        if gated:
            gate, up = row[:n_out].float(), row[n_out:].float()
            row = (F.silu(gate).to(dtype).float() * up).to(dtype)
        if residual is not None:
            row = (row.float() + residual[i].float()).to(dtype)
        out[i] = row
    if emit_norm_weight is not None:
        return out, norm_inputs_reference(out, emit_norm_weight)
    return out
