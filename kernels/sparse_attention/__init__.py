"""Sparse decode/verify attention at long context: attend only to the top-k key blocks per lane.

    summary = BlockKeySummary.for_cache(k_cache, block_size=64)
    summary.update(k_cache, old_len, new_len)              # after every cache write
    out = sparse_decode_attention(q, k_cache, v_cache, seq_len, summary, top_k=64)

Each block of `block_size` cache rows keeps the min and max of K per KV head. For every lane and KV
head group a block scores the Quest upper bound (arXiv 2406.10774) sum_d max(q_d*kmin_d, q_d*kmax_d),
maximised over the group's query heads; the top_k blocks are kept, always including the first (sink)
block and the `recent_blocks` blocks holding the lane's last visible rows. Attention then reads only
those blocks' rows, with the same per-lane causal visibility as dense attention.

Sparse attention is lossy. `sparse_decode_attention` uses it only when the selection removes more
than half of every lane's visible rows (2 * top_k * block_size < shortest lane's visible rows) and
computes exact dense attention otherwise.
"""
from __future__ import annotations

import math

import torch

from kernels._backend import resolve_backend, seq_len_tensor
from kernels.decode_attention import check_attention_inputs, decode_attention
from kernels.sparse_attention.reference import (
    block_scores_reference,
    select_from_scores,
    selection_visibility,
    sparse_attention_reference,
)
from kernels.sparse_attention.summary import BlockKeySummary


def sparse_is_worthwhile(min_seq_len: int, q_rows: int, top_k: int, block_size: int) -> bool:
    """True when top_k blocks keep fewer than half of the rows that the lane seeing least can see."""
    min_visible = min_seq_len - q_rows + 1
    return 2 * top_k * block_size < min_visible


def _check_summary(q: torch.Tensor, k_cache: torch.Tensor, summary: BlockKeySummary, top_k: int,
                   recent_blocks: int) -> None:
    B, Hkv, S_max, D = k_cache.shape
    if tuple(summary.kmin.shape) != (B, Hkv, -(-S_max // summary.block_size), D):
        raise ValueError(f"summary blocks {list(summary.kmin.shape)} do not fit k_cache {list(k_cache.shape)} "
                         f"in blocks of {summary.block_size}")
    if summary.kmin.device != q.device:
        raise ValueError(f"summary on {summary.kmin.device} but q on {q.device}")
    if recent_blocks < 1:
        raise ValueError(f"recent_blocks must be >= 1 (the block holding the lane's own rows), got {recent_blocks}")
    if not 1 + recent_blocks <= top_k <= summary.n_blocks:
        raise ValueError(f"top_k must be in {1 + recent_blocks}..{summary.n_blocks} (sink + {recent_blocks} recent "
                         f"blocks .. all blocks), got {top_k}")


def select_blocks(
    q: torch.Tensor,                       # [B, Hq, Q, D]
    summary: BlockKeySummary,
    seq_len: torch.Tensor,                 # [B] int64 on q's device
    *,
    top_k: int,
    recent_blocks: int = 2,
    backend: str = "auto",
) -> torch.Tensor:
    """-> block ids [B, Hkv, Q, top_k] int64 (in no order) for each lane and KV head group."""
    if resolve_backend(backend, q.device) == "reference":
        scores = block_scores_reference(q, summary.kmin, summary.kmax, seq_len, summary.block_size, recent_blocks)
    else:
        from kernels.sparse_attention.triton_kernel import block_scores_triton

        scores = block_scores_triton(q, summary.kmin, summary.kmax, seq_len, summary.block_size, recent_blocks)
    return select_from_scores(scores, top_k)


def sparse_attention(
    q: torch.Tensor,                       # [B, Hq, Q, D]
    k_cache: torch.Tensor,                 # [B, Hkv, S_max, D]
    v_cache: torch.Tensor,                 # [B, Hkv, S_max, D]
    seq_len: torch.Tensor,                 # [B] int64 on q's device
    block_ids: torch.Tensor,               # [B, Hkv, Q, top_k] from select_blocks
    *,
    block_size: int,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention over exactly the selected blocks' causally visible rows. -> [B, Hq, Q, D] in q's dtype."""
    check_attention_inputs(q, k_cache, v_cache)
    B, Hq, QR, D = q.shape
    Hkv = k_cache.shape[1]
    if block_ids.dim() != 4 or tuple(block_ids.shape[:3]) != (B, Hkv, QR):
        raise ValueError(f"block_ids must be [{B}, {Hkv}, {QR}, top_k], got {list(block_ids.shape)}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if resolve_backend(backend, q.device) == "reference":
        return sparse_attention_reference(q, k_cache, v_cache, seq_len, block_ids, block_size, scale)
    from kernels.sparse_attention.triton_kernel import sparse_attention_triton

    return sparse_attention_triton(q, k_cache, v_cache, seq_len, block_ids, block_size, scale)


def sparse_decode_attention(
    q: torch.Tensor,                       # [B, Hq, Q, D], Q = 1..16
    k_cache: torch.Tensor,                 # [B, Hkv, S_max, D]
    v_cache: torch.Tensor,                 # [B, Hkv, S_max, D]
    seq_len: int | torch.Tensor,           # int or int64 [B]: valid rows including the Q new rows
    summary: BlockKeySummary,              # up to date with the cache (summary.update after each write)
    *,
    top_k: int,                            # blocks kept per lane and KV head group, sink and recent included
    recent_blocks: int = 2,
    scale: float | None = None,
    backend: str = "auto",
    min_seq_len: int | None = None,        # host lower bound of seq_len for the sparse/dense rule
) -> torch.Tensor:
    """Sparse attention where it removes more than half of the visible rows, exact dense attention elsewhere.

    The rule needs seq_len on the host: an int, or `min_seq_len`; otherwise a tensor seq_len is read
    back (a sync). -> [B, Hq, Q, D] in q's dtype.
    """
    check_attention_inputs(q, k_cache, v_cache)
    _check_summary(q, k_cache, summary, top_k, recent_blocks)
    B, _, QR, _ = q.shape
    if min_seq_len is None:
        min_seq_len = int(seq_len.min()) if isinstance(seq_len, torch.Tensor) else int(seq_len)
    if not sparse_is_worthwhile(min_seq_len, QR, top_k, summary.block_size):
        return decode_attention(q, k_cache, v_cache, seq_len, scale=scale, backend=backend)
    if isinstance(seq_len, int) and summary.length < seq_len:
        raise ValueError(f"summary covers {summary.length} rows but seq_len is {seq_len}: call summary.update")
    lengths = seq_len_tensor(seq_len, B, k_cache.shape[2], q.device)
    block_ids = select_blocks(q, summary, lengths, top_k=top_k, recent_blocks=recent_blocks, backend=backend)
    return sparse_attention(q, k_cache, v_cache, lengths, block_ids, block_size=summary.block_size,
                            scale=scale, backend=backend)


__all__ = [
    "BlockKeySummary",
    "sparse_decode_attention",
    "sparse_attention",
    "select_blocks",
    "sparse_is_worthwhile",
    "block_scores_reference",
    "select_from_scores",
    "selection_visibility",
    "sparse_attention_reference",
]
