"""The two RMSNorms V4 uses, computed in float32 and returned in the input's dtype (as transformers);
each row reduced as it is alone: on CUDA one program a row (kernels.rms_norm.rms_norm_f32, one
launch where the eager ops took about ten), elsewhere engine.deepseek_v4.rows.mean_square."""
from __future__ import annotations

import torch
from torch import nn

from batchd.engine.deepseek_v4.rows import mean_square
from batchd.kernels.rms_norm import rms_norm_f32


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last axis, in float32."""
    if x.is_cuda:
        return rms_norm_f32(x, None, eps, torch.float32)
    x = x.float()
    return x * torch.rsqrt(mean_square(x) + eps)


class RMSNorm(nn.Module):
    """Weighted RMSNorm (its weight kept in float32, as transformers keeps V4's norms)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return rms_norm_f32(x, self.weight, self.eps, x.dtype)
        return (self.weight.float() * rms_normalize(x, self.eps)).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The per-head query norm: no weight. (On CUDA rounded once, where the eager form rounds the
    inverse rms to x's dtype before its product.)"""
    if x.is_cuda:
        return rms_norm_f32(x, None, eps, x.dtype)
    return (x * torch.rsqrt(mean_square(x.float()) + eps).to(x.dtype))
