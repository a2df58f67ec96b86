"""Plain PyTorch twins of block scoring, block selection and attention over selected blocks."""
from __future__ import annotations

import torch

from batchd.kernels.decode_attention.reference import causal_visibility, masked_attention_reference


def lane_limits(seq_len: torch.Tensor, q_rows: int) -> torch.Tensor:
    """Last visible cache row of each lane. -> [B, Q]"""
    return seq_len[:, None] - q_rows + torch.arange(q_rows, device=seq_len.device)[None, :]


def block_scores_reference(
    q: torch.Tensor,            # [B, Hq, Q, D]
    kmin: torch.Tensor,         # [B, Hkv, NB, D]
    kmax: torch.Tensor,         # [B, Hkv, NB, D]
    seq_len: torch.Tensor,      # [B] int64
    block_size: int,
    recent_blocks: int,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Quest upper bound per (lane, KV head group, block). -> [B, Hkv, Q, NB] float32

    bound[h, i, j] = sum_d max(q[h, i, d] * kmin[j, d], q[h, i, d] * kmax[j, d]) >= q . k for every k
    in block j; a group takes the max over its G query heads. Blocks a lane cannot see score -inf;
    the sink block and the lane's `recent_blocks` last visible blocks score +inf (always kept).
    """
    B, Hq, QR, D = q.shape
    Hkv, NB = kmin.shape[1], kmin.shape[2]
    qg = q.to(compute_dtype).reshape(B, Hkv, Hq // Hkv, QR, 1, D)
    lo = kmin.to(compute_dtype)[:, :, None, None]                  # [B, Hkv, 1, 1, NB, D]
    hi = kmax.to(compute_dtype)[:, :, None, None]
    bound = torch.maximum(qg * lo, qg * hi).sum(-1).amax(dim=2)      # [B, Hkv, Q, NB]
    last_block = (lane_limits(seq_len, QR) // block_size)[:, None, :, None]   # [B, 1, Q, 1]
    blocks = torch.arange(NB, device=q.device)
    visible = blocks <= last_block
    forced = visible & ((blocks == 0) | (blocks > last_block - recent_blocks))
    scores = bound.float().masked_fill(~visible, float("-inf"))
    return scores.masked_fill(forced, float("inf"))


def select_from_scores(
    scores: torch.Tensor,       # [B, Hkv, Q, NB] from block_scores_reference
    top_k: int,
    seq_len: torch.Tensor,      # [B] int64
    keep_all_rows: int,
) -> torch.Tensor:
    """Blocks each lane attends to. -> [B, Hkv, Q, NB] bool

    The top_k highest-scoring blocks (ties: the lowest block ids), less any the lane cannot see; a lane
    that sees at most `keep_all_rows` rows keeps every block it sees (dense attention for it).
    """
    QR = scores.shape[2]
    best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :top_k]
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, best, True)
    keep_all = (lane_limits(seq_len, QR) + 1 <= keep_all_rows)[:, None, :, None]       # [B, 1, Q, 1]
    return (chosen | keep_all) & (scores > float("-inf"))


def selection_visibility(selected: torch.Tensor, seq_len: torch.Tensor, q_rows: int, block_size: int,
                         max_len: int) -> torch.Tensor:
    """visible[b, h, i, n]: row n is in a block chosen for (b, h, lane i) and causally visible. -> bool"""
    rows = selected.repeat_interleave(block_size, dim=-1)[..., :max_len]          # [B, Hkv, Q, S]
    return rows & causal_visibility(seq_len, q_rows, max_len)[:, None]


def sparse_attention_reference(
    q: torch.Tensor,            # [B, Hq, Q, D]
    k_cache: torch.Tensor,      # [B, Hkv, S_max, D]
    v_cache: torch.Tensor,      # [B, Hkv, S_max, D]
    seq_len: torch.Tensor,      # [B] int64
    selected: torch.Tensor,     # [B, Hkv, Q, NB] bool from select_from_scores
    block_size: int,
    scale: float,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Attention restricted to the selected blocks' causally visible rows. -> [B, Hq, Q, D] in q's dtype

    Lane by lane, each over the cache rows up to its own last visible one: the computation a lane gets
    alone as a one-row step, so on the CPU too a verify lane equals its decode step bitwise (B = 1).
    """
    QR = q.shape[2]
    limits = lane_limits(seq_len, QR)                               # [B, Q]
    lanes = []
    for i in range(QR):
        lane_len = limits[:, i] + 1                                 # the lane as a one-row step's seq_len
        rows = int(lane_len.max())                                  # host sync: the reference is not for graphs
        visible = selection_visibility(selected[:, :, i:i + 1], lane_len, 1, block_size, rows)
        lanes.append(masked_attention_reference(q[:, :, i:i + 1], k_cache[:, :, :rows], v_cache[:, :, :rows],
                                                visible, scale, compute_dtype))
    return torch.cat(lanes, dim=2).to(q.dtype)
