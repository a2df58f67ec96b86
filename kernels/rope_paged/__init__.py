"""Rotary embedding of a batch's q and k rows plus their k/v write into the paged pool, in one launch.

    q = rope_paged_store(q, k, v, cos, sin, k_pool, v_pool, write_blocks, write_offsets)

q [N, Hq, D], k and v [N, Hkv, D]: rows of many sequences (decode, verify or packed prompt rows),
typically views of the fused q/k/v projection output [N, (Hq + 2 Hkv) D] (qwen3's per-head norm,
when there is one, already applied to q and k); any row and head strides, unit stride along D.
cos, sin [N, D] or [N, 1, D] float32, gathered at each row's position ("rotate half", HF's layout).
k_pool, v_pool [blocks + 1, Hkv, block_size, D] (engine.batch.paged_cache): row n's rotated key and
its value go to (write_blocks[n], :, write_offsets[n], :) ([N] integer tensors on the device, never
read on the host: CUDA-graph safe). Returns the rotated queries [N, Hq, D] (contiguous).

Bit for bit the eager ops (`reference`): the tables rounded to q's dtype, each product rounded to
it, the sum rounded; k cast to the pool's dtype afterwards, v cast to it.
"""
from __future__ import annotations

import torch

from batchd.kernels._backend import resolve_backend
from batchd.kernels.rope_paged.reference import rope_paged_store_reference


def check_rope_paged_inputs(q, k, v, cos, sin, k_pool, v_pool, write_blocks, write_offsets) -> None:
    """Raise ValueError naming the numbers when the rows, tables, pools and write slots do not fit."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [N, H, D], got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    N, _, D = q.shape
    if k.shape != v.shape or k.shape[0] != N or k.shape[2] != D:
        raise ValueError(f"k {list(k.shape)} and v {list(v.shape)} must be [{N}, Hkv, {D}] for q {list(q.shape)}")
    if k.dtype != q.dtype:
        raise ValueError(f"q ({q.dtype}) and k ({k.dtype}) must share a dtype")
    Hkv = k.shape[1]
    if k_pool.dim() != 4 or k_pool.shape != v_pool.shape or k_pool.shape[1] != Hkv or k_pool.shape[3] != D:
        raise ValueError(f"pools {list(k_pool.shape)}, {list(v_pool.shape)} must be "
                         f"[blocks + 1, {Hkv}, block_size, {D}]")
    if k_pool.dtype != v_pool.dtype:
        raise ValueError(f"k_pool ({k_pool.dtype}) and v_pool ({v_pool.dtype}) must share a dtype")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape not in ((N, D), (N, 1, D)):
            raise ValueError(f"{name} {list(table.shape)} must be [{N}, {D}] or [{N}, 1, {D}]")
    for name, slots in (("write_blocks", write_blocks), ("write_offsets", write_offsets)):
        if slots.shape != (N,) or slots.dtype.is_floating_point or slots.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor [{N}], got {slots.dtype} {list(slots.shape)}")
    if D % 2:
        raise ValueError(f"head_dim must be even, got {D}")


def rope_paged_store(q, k, v, cos, sin, k_pool, v_pool, write_blocks, write_offsets, *,
                     backend: str = "auto") -> torch.Tensor:
    check_rope_paged_inputs(q, k, v, cos, sin, k_pool, v_pool, write_blocks, write_offsets)
    N, _, D = q.shape
    if resolve_backend(backend, q.device) == "reference":
        return rope_paged_store_reference(q, k, v, cos, sin, k_pool, v_pool, write_blocks, write_offsets)
    from batchd.kernels.rope_paged.triton_kernel import rope_paged_store_triton

    unit = [t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v)]
    return rope_paged_store_triton(*unit, cos.reshape(N, D).contiguous(), sin.reshape(N, D).contiguous(), k_pool,
                                   v_pool, write_blocks, write_offsets)


__all__ = ["rope_paged_store", "rope_paged_store_reference", "check_rope_paged_inputs"]
