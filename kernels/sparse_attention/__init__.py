"""Sparse decode/verify attention at long context: attend only to the top-k key blocks per lane.

    summary = BlockKeySummary.for_cache(k_cache, block_size=64)
    summary.update(k_cache, old_len, new_len)              # after every cache write
    out = sparse_decode_attention(q, k_cache, v_cache, seq_len, summary, top_k=64)

Each block of `block_size` cache rows keeps the min and max of K per KV head. For every lane and KV
head group a block scores the Quest upper bound (arXiv 2406.10774) sum_d max(q_d*kmin_d, q_d*kmax_d),
maximised over the group's query heads; the top_k blocks are kept, always including the first (sink)
block and the `recent_blocks` blocks holding the lane's last visible rows. Attention then reads each
block that some lane of the group kept once for all lanes, masking it for the lanes that did not keep
it, with the same per-lane causal visibility as dense attention.

Sparse attention is lossy. A lane uses it only when it removes more than half of the lane's visible
rows (2 * top_k * block_size < visible rows); a lane below that keeps all its blocks and gets exactly
dense attention. `sparse_decode_attention` runs the dense kernel when no lane of the shortest
sequence is past that point.

Each lane's output is bitwise what it gets alone as a one-row decode step at its position (Triton
kernels; block choice, split boundaries and tile shapes do not depend on Q), and a lane that keeps
all its blocks equals the dense kernel bitwise when block_size is the dense kernel's 64: greedy
output does not change when speculation is switched on, with sparse attention on too.
"""
from __future__ import annotations

import math

import torch

from batchd.kernels._backend import resolve_backend, seq_len_tensor
from batchd.kernels.decode_attention import check_attention_inputs, decode_attention
from batchd.kernels.sparse_attention.reference import (
    block_scores_reference,
    select_from_scores,
    selection_visibility,
    sparse_attention_reference,
)
from batchd.kernels.sparse_attention.summary import BlockKeySummary


def keep_all_rows(top_k: int, block_size: int) -> int:
    """A lane that sees at most this many rows keeps all its blocks (top_k would keep half or more)."""
    return 2 * top_k * block_size


def sparse_is_worthwhile(min_seq_len: int, q_rows: int, top_k: int, block_size: int) -> bool:
    """True when the last lane of the shortest sequence (it sees min_seq_len rows) would drop more than
    half of its rows. Lanes that see fewer rows keep all theirs, so q_rows does not change the answer;
    the rule is per lane so that a lane attends the same way in a Q-row step and alone (Q = 1)."""
    del q_rows
    return keep_all_rows(top_k, block_size) < min_seq_len


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
    """-> chosen blocks [B, Hkv, Q, NB] bool for each KV head group and lane (reference.select_from_scores).

    Fixed shapes and no host sync on the Triton path (CUDA graphs); a lane's row does not depend on Q.
    """
    keep_all = keep_all_rows(top_k, summary.block_size)
    if resolve_backend(backend, q.device) == "reference":
        scores = block_scores_reference(q, summary.kmin, summary.kmax, seq_len, summary.block_size, recent_blocks)
        return select_from_scores(scores, top_k, seq_len, keep_all)
    from batchd.kernels.sparse_attention.triton_kernel import block_scores_triton, select_from_scores_triton

    scores = block_scores_triton(q, summary.kmin, summary.kmax, seq_len, summary.block_size, recent_blocks)
    return select_from_scores_triton(scores, seq_len, top_k, keep_all)


def sparse_attention(
    q: torch.Tensor,                       # [B, Hq, Q, D]
    k_cache: torch.Tensor,                 # [B, Hkv, S_max, D]
    v_cache: torch.Tensor,                 # [B, Hkv, S_max, D]
    seq_len: torch.Tensor,                 # [B] int64 on q's device
    selected: torch.Tensor,                # [B, Hkv, Q, NB] bool from select_blocks
    *,
    block_size: int,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention over exactly the chosen blocks' causally visible rows, per lane. -> [B, Hq, Q, D] in q's dtype."""
    check_attention_inputs(q, k_cache, v_cache)
    B, Hq, QR, D = q.shape
    Hkv, S_max = k_cache.shape[1], k_cache.shape[2]
    n_blocks = -(-S_max // block_size)
    if tuple(selected.shape) != (B, Hkv, QR, n_blocks) or selected.dtype != torch.bool:
        raise ValueError(f"selected must be bool [{B}, {Hkv}, {QR}, {n_blocks}] (blocks of {block_size} rows), "
                         f"got {selected.dtype} {list(selected.shape)}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if resolve_backend(backend, q.device) == "reference":
        return sparse_attention_reference(q, k_cache, v_cache, seq_len, selected, block_size, scale)
    from batchd.kernels.sparse_attention.triton_kernel import sparse_attention_triton

    return sparse_attention_triton(q, k_cache, v_cache, seq_len, selected, block_size, scale)


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
    """Sparse attention for the lanes where it removes more than half of the visible rows, exact dense
    attention for the others (sparse_is_worthwhile, keep_all_rows).

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
    selected = select_blocks(q, summary, lengths, top_k=top_k, recent_blocks=recent_blocks, backend=backend)
    return sparse_attention(q, k_cache, v_cache, lengths, selected, block_size=summary.block_size,
                            scale=scale, backend=backend)


__all__ = [
    "BlockKeySummary",
    "sparse_decode_attention",
    "sparse_attention",
    "select_blocks",
    "sparse_is_worthwhile",
    "keep_all_rows",
    "block_scores_reference",
    "select_from_scores",
    "selection_visibility",
    "sparse_attention_reference",
]
