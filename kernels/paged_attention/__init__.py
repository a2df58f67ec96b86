"""Attention of decode, verify and replay rows of many sequences over a paged KV cache, one launch.

    out = paged_decode_attention(q, k_pool, v_pool, block_tables, seq_lens)

q: [N, Hq, D], one query row per entry (a sequence's decode token, or one lane of its verify
step); k_pool, v_pool: [num_blocks, Hkv, block_size, D] in bf16/f16/f32, read in their own dtype;
block_tables: [N, max_blocks] int32, the row's sequence's blocks in order; seq_lens: [N] int32,
the keys row n sees are its sequence's positions [0, seq_lens[n]). Returns [N, Hq, D] in q's dtype.

Batch invariance: a row's arithmetic depends on its own length only. Keys are split into pieces of
`split_blocks` blocks counted from position 0, each piece reduced in block order, and the pieces
merged in order; no choice depends on how many rows share the launch or where the row sits.
"""
from __future__ import annotations

import torch

from batchd.kernels._backend import resolve_backend
from batchd.kernels.paged_attention.reference import paged_decode_attention_reference

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SPLIT_BLOCKS = 8  # blocks per split: 512 keys at 64-row blocks; a 4K-token row takes 8 splits


def check_paged_inputs(q, k_pool, v_pool, block_tables, seq_lens) -> None:
    """Raise ValueError naming the numbers when shapes, dtypes or devices do not fit together."""
    if q.dim() != 3 or k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"expected q [N, Hq, D] and pools [blocks, Hkv, block_size, D], got q {list(q.shape)}, "
                         f"k_pool {list(k_pool.shape)}, v_pool {list(v_pool.shape)}")
    N, Hq, D = q.shape
    _, Hkv, block_size, Dk = k_pool.shape
    if Dk != D or Hq % Hkv:
        raise ValueError(f"q {list(q.shape)} does not fit pools {list(k_pool.shape)}: head dim or heads")
    if block_tables.shape[0] != N or block_tables.dim() != 2 or seq_lens.shape != (N,):
        raise ValueError(f"block_tables [N, max_blocks] and seq_lens [N] for N = {N}, got "
                         f"{list(block_tables.shape)} and {list(seq_lens.shape)}")
    if q.dtype not in DTYPES or k_pool.dtype not in DTYPES or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"q and pools must be one of {DTYPES}, got {q.dtype}, {k_pool.dtype}, {v_pool.dtype}")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError(f"block_tables and seq_lens must be int32, got {block_tables.dtype}, {seq_lens.dtype}")


def paged_decode_attention(q, k_pool, v_pool, block_tables, seq_lens, *, scale: float | None = None,
                           max_seq_len: int | None = None, split_blocks: int = SPLIT_BLOCKS,
                           backend: str = "auto") -> torch.Tensor:
    """See the module docstring. `max_seq_len` bounds the grid (the host knows it; a CUDA graph
    passes the largest length it may replay at); it changes no row's arithmetic."""
    check_paged_inputs(q, k_pool, v_pool, block_tables, seq_lens)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if resolve_backend(backend, q.device) == "reference":
        return paged_decode_attention_reference(q, k_pool, v_pool, block_tables, seq_lens, scale=scale)
    from batchd.kernels.paged_attention.triton_kernel import paged_decode_attention_triton

    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * k_pool.shape[2]
    return paged_decode_attention_triton(q, k_pool, v_pool, block_tables, seq_lens, scale=scale,
                                         max_seq_len=max_seq_len, split_blocks=split_blocks)


__all__ = ["paged_decode_attention", "paged_decode_attention_reference", "SPLIT_BLOCKS"]
