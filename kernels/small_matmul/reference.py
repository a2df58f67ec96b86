"""Plain PyTorch twin of the batch-invariant small-M linear (the definition the kernel is tested against).

Each row is computed on its own, in float32, so row i of the result depends on x[i] alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def small_linear_reference(
    x: torch.Tensor,                     # [M, K]
    weight: torch.Tensor,                # [N, K] ([2N, K] gate then up when gated)
    bias: torch.Tensor | None = None,    # [N]
    compute_dtype: torch.dtype = torch.float32,
    *,
    norm_weight: torch.Tensor | None = None,   # [K]
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,      # [M, N]
    gated: bool = False,
) -> torch.Tensor:
    """out[i] = weight @ x[i] (+ bias), one row at a time in `compute_dtype`. -> [M, N] in x's dtype.

    The fusions: RMSNorm of x[i] with the row's scale applied after the sum,
    rsqrt(mean(x[i]^2) + eps) * (W (norm_weight * x[i])) with norm_weight * x[i] rounded to x's
    dtype (the MMA's input); silu(gate) * up with gate, up and silu(gate) rounded to x's dtype; then
    residual[i] + out[i], the product rounded first."""
    dtype = x.dtype
    row_scale = None
    if norm_weight is not None:
        x32 = x.float()
        row_scale = torch.rsqrt(x32.pow(2).mean(-1) + eps).to(compute_dtype)  # [M]
        x = (x32 * norm_weight.float()).to(dtype)
    w = weight.to(compute_dtype)
    b = None if bias is None else bias.to(compute_dtype)
    n_out = weight.shape[0] // 2 if gated else weight.shape[0]
    out = torch.empty(x.shape[0], n_out, dtype=dtype, device=x.device)
    for i in range(x.shape[0]):
        row = w @ x[i].to(compute_dtype)
        if row_scale is not None:
            row = row * row_scale[i]
        if b is not None:
            row = row + b
        row = row.to(dtype)
        if gated:
            gate, up = row[:n_out].float(), row[n_out:].float()
            row = (F.silu(gate).to(dtype).float() * up).to(dtype)
        if residual is not None:
            row = (row.float() + residual[i].float()).to(dtype)
        out[i] = row
    return out
