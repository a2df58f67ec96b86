"""The two RMSNorms V4 uses, computed in float32 and returned in the input's dtype (as transformers);
each row reduced as it is alone (engine.deepseek_v4.rows.mean_square)."""
from __future__ import annotations

import torch
from torch import nn

from batchd.engine.deepseek_v4.rows import mean_square


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last axis, in float32."""
    x = x.float()
    return x * torch.rsqrt(mean_square(x) + eps)


class RMSNorm(nn.Module):
    """Weighted RMSNorm (its weight kept in float32, as transformers keeps V4's norms)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight.float() * rms_normalize(x, self.eps)).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The per-head query norm and the hyper-connections' input norm: no weight."""
    return (x * torch.rsqrt(mean_square(x.float()) + eps).to(x.dtype))
