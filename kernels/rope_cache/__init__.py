"""Rotary embedding of q and k plus the k/v cache write of one step, in one launch.

    q = rope_and_store(qkv, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads)

qkv is the fused projection output [B, T, (Hq + 2 Hkv) D]; cos, sin [T, D] float32 ("rotate half"
layout, HF's); positions [T] int64 cache rows (on the device: CUDA-graph safe); caches
[B, Hkv, S_max, D] in the model's dtype. Optional q_norm/k_norm [D] apply qwen3's per-head RMSNorm
first. Returns the rotated queries [B, Hq, T, D].
"""
from __future__ import annotations

import torch

from batchd.kernels._backend import resolve_backend
from batchd.kernels.rope_cache.reference import rope_and_store_reference


def check_rope_inputs(B: int, T: int, width: int, cos, sin, positions, k_cache, v_cache, num_heads: int,
                      num_kv_heads: int) -> None:
    """Raise ValueError naming the numbers when a step's q/k/v rows [B, T, width], rope tables and
    caches do not fit together."""
    D = k_cache.shape[-1]
    if width != (num_heads + 2 * num_kv_heads) * D:
        raise ValueError(f"qkv width {width} != (Hq {num_heads} + 2 * Hkv {num_kv_heads}) * D {D}")
    if cos.shape != (T, D) or sin.shape != (T, D) or positions.shape != (T,):
        raise ValueError(f"cos {list(cos.shape)}, sin {list(sin.shape)} must be [{T}, {D}] and positions "
                         f"{list(positions.shape)} [{T}]")
    if k_cache.shape != v_cache.shape or k_cache.shape[:2] != (B, num_kv_heads):
        raise ValueError(f"caches {list(k_cache.shape)}, {list(v_cache.shape)} must be [{B}, {num_kv_heads}, S, {D}]")
    if D % 2 or D & (D - 1):
        raise ValueError(f"head_dim must be a power of two, got {D}")


def rope_and_store(qkv, cos, sin, positions, k_cache, v_cache, num_heads: int, num_kv_heads: int, *,
                   q_norm=None, k_norm=None, eps: float = 1e-6, backend: str = "auto") -> torch.Tensor:
    B, T, width = qkv.shape
    check_rope_inputs(B, T, width, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads)
    if (q_norm is None) != (k_norm is None):
        raise ValueError("give both q_norm and k_norm, or neither")
    if resolve_backend(backend, qkv.device) == "reference" or qkv.stride(-1) != 1 or qkv.dtype != k_cache.dtype:
        return rope_and_store_reference(qkv, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads,
                                        q_norm, k_norm, eps)
    from batchd.kernels.rope_cache.triton_kernel import rope_and_store_triton

    return rope_and_store_triton(qkv.contiguous(), cos.contiguous(), sin.contiguous(), positions, k_cache, v_cache,
                                 num_heads, num_kv_heads, q_norm, k_norm, eps)


__all__ = ["rope_and_store", "rope_and_store_reference", "check_rope_inputs"]
