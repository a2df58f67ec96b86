"""PyTorch twin of the fused rope + KV-cache write: the engine's eager code path, op for op."""
from __future__ import annotations

import torch


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D] per-head RMSNorm (qwen3's q_norm / k_norm), float32 statistics."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos, sin: [T, D] float32, cast to x's dtype first (as HF does)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def rope_and_store_reference(qkv, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads,
                             q_norm=None, k_norm=None, eps=1e-6):
    """qkv: [B, T, (Hq + 2 Hkv) D] -> q [B, Hq, T, D] rotated; k rotated and v written to the caches
    [B, Hkv, S_max, D] at rows `positions` [T]."""
    B, T, _ = qkv.shape
    D = k_cache.shape[-1]
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    q = q.view(B, T, num_heads, D)
    k = k.view(B, T, num_kv_heads, D)
    if q_norm is not None:
        q, k = rms_norm_heads(q, q_norm, eps), rms_norm_heads(k, k_norm, eps)
    q = rotate_half(q.transpose(1, 2), cos, sin)
    k = rotate_half(k.transpose(1, 2), cos, sin)
    v = v.view(B, T, num_kv_heads, D).transpose(1, 2)
    k_cache.index_copy_(2, positions, k.to(k_cache.dtype))
    v_cache.index_copy_(2, positions, v.to(v_cache.dtype))
    return q
