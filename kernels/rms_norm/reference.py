"""PyTorch twin of the row-invariant RMSNorm: the engine's eager ops."""
from __future__ import annotations

import torch


def rms_norm_reference(x, weight, eps, residual=None):
    """x, residual: [..., H]. Returns (normed, x + residual or x), statistics in float32."""
    h = x if residual is None else x + residual
    h32 = h.float()
    normed = weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return normed, h


def rms_norm_f32_reference(x, weight, eps, out_dtype):
    """x [..., H], weight [H] or None -> weight * x / rms(x) [..., H] in out_dtype: statistics,
    normalised value and weight product in float32, rounded once (DeepSeek V4's norms)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
    return (normed if weight is None else weight.float() * normed).to(out_dtype)
