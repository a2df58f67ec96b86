"""PyTorch twin of the fused rope + paged-pool write: the batch engine's eager ops, op for op
(engine.fused.rotate, then engine.batch.paged_cache.PagedKVCache.write)."""
from __future__ import annotations

import torch


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, H, D]; cos, sin: [N, 1, D] float32, cast to x's dtype first ("rotate half", as HF)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rope_paged_store_reference(q, k, v, cos, sin, k_pool, v_pool, write_blocks, write_offsets) -> torch.Tensor:
    """q [N, Hq, D], k and v [N, Hkv, D]; cos, sin [N, 1, D] or [N, D] -> rotated q [N, Hq, D]. Rotated
    k and v go to the pools [blocks + 1, Hkv, block_size, D] at (write_blocks[n], :, write_offsets[n])."""
    cos, sin = cos.reshape(q.shape[0], 1, -1), sin.reshape(q.shape[0], 1, -1)   # broadcast over heads
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    k_pool[write_blocks, :, write_offsets] = k.to(k_pool.dtype)
    v_pool[write_blocks, :, write_offsets] = v.to(v_pool.dtype)
    return q
