"""Plain PyTorch twin of the batch-invariant small-M linear (the definition the kernel is tested against).

Each row is computed on its own, in float32, so row i of the result depends on x[i] alone.
"""
from __future__ import annotations

import torch


def small_linear_reference(
    x: torch.Tensor,                     # [M, K]
    weight: torch.Tensor,                # [N, K]
    bias: torch.Tensor | None = None,    # [N]
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """out[i] = weight @ x[i] (+ bias), one row at a time in `compute_dtype`. -> [M, N] in x's dtype."""
    w = weight.to(compute_dtype)
    b = None if bias is None else bias.to(compute_dtype)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    for i in range(x.shape[0]):
        row = w @ x[i].to(compute_dtype)
        if b is not None:
            row = row + b
        out[i] = row.to(x.dtype)
    return out
