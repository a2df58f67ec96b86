"""Causal prefill attention of many prompt chunks over a paged KV cache, one launch.

    out = paged_prefill_attention(q, k_pool, v_pool, block_tables, row_starts, chunk_rows, first_positions)

q: [N, Hq, D], the rows of C prompt chunks packed one after another (chunk c's rows are
q[row_starts[c] : row_starts[c] + chunk_rows[c]], at positions first_positions[c] + 0, 1, ...);
k_pool, v_pool: [num_blocks, Hkv, block_size, D] holding every key and value the chunks see,
their own rows included (written before the call); block_tables: [C, max_blocks] int32, chunk
c's sequence's blocks. Row i of chunk c sees its sequence's positions [0, first_positions[c] + i].
Returns [N, Hq, D] in q's dtype. GQA: Hq a multiple of Hkv.

Batch invariance: query tiles start at each chunk's first row and keys are reduced block by block
from position 0, so a row's arithmetic depends on its chunk (fixed by its sequence) and its
position only, never on the other chunks in the launch.
"""
from __future__ import annotations

import torch

from batchd.kernels._backend import resolve_backend
from batchd.kernels.paged_prefill.reference import paged_prefill_attention_reference

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_prefill_inputs(q, k_pool, v_pool, block_tables, row_starts, chunk_rows, first_positions) -> None:
    """Raise ValueError naming the numbers when shapes, dtypes or devices do not fit together."""
    if q.dim() != 3 or k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"expected q [N, Hq, D] and pools [blocks, Hkv, block_size, D], got q {list(q.shape)}, "
                         f"k_pool {list(k_pool.shape)}, v_pool {list(v_pool.shape)}")
    _, Hq, D = q.shape
    if k_pool.shape[3] != D or Hq % k_pool.shape[1]:
        raise ValueError(f"q {list(q.shape)} does not fit pools {list(k_pool.shape)}: head dim or heads")
    C = block_tables.shape[0]
    if block_tables.dim() != 2 or any(t.shape != (C,) for t in (row_starts, chunk_rows, first_positions)):
        raise ValueError(f"block_tables [C, max_blocks] and row_starts, chunk_rows, first_positions [C], got "
                         f"{list(block_tables.shape)}, {list(row_starts.shape)}, {list(chunk_rows.shape)}, "
                         f"{list(first_positions.shape)}")
    if any(t.dtype != torch.int32 for t in (block_tables, row_starts, chunk_rows, first_positions)):
        raise ValueError("block_tables, row_starts, chunk_rows and first_positions must be int32")
    if q.dtype not in DTYPES or k_pool.dtype not in DTYPES or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"q and pools must be one of {DTYPES}, got {q.dtype}, {k_pool.dtype}, {v_pool.dtype}")


def paged_prefill_attention(q, k_pool, v_pool, block_tables, row_starts, chunk_rows, first_positions, *,
                            scale: float | None = None, host_chunk_rows: list[int] | None = None,
                            backend: str = "auto") -> torch.Tensor:
    """See the module docstring. `host_chunk_rows`: chunk_rows as a host list, if the caller has it."""
    check_prefill_inputs(q, k_pool, v_pool, block_tables, row_starts, chunk_rows, first_positions)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if resolve_backend(backend, q.device) == "reference":
        return paged_prefill_attention_reference(q, k_pool, v_pool, block_tables, row_starts, chunk_rows,
                                                 first_positions, scale=scale)
    from batchd.kernels.paged_prefill.triton_kernel import paged_prefill_attention_triton

    return paged_prefill_attention_triton(q, k_pool, v_pool, block_tables, row_starts, chunk_rows, first_positions,
                                          scale=scale, host_chunk_rows=host_chunk_rows)


__all__ = ["paged_prefill_attention", "paged_prefill_attention_reference"]
