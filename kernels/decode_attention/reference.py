"""Plain PyTorch twin of the decode/verify attention kernel (the definition the kernel is tested against).

Lane i of Q query rows sees cache rows [0, seq_len - Q + i] (lower-right causal): the Q new rows are
already written at the end of the valid region. Grouped-query heads: q head h reads KV head h // G.
"""
from __future__ import annotations

import math

import torch

MAX_Q_ROWS = 16    # query rows a sequence per call: a decode step (1) up to a verify of 15 drafts and the bonus row


def causal_visibility(seq_len: torch.Tensor, q_rows: int, max_len: int) -> torch.Tensor:
    """visible[b, i, n] = (n <= seq_len[b] - Q + i).  -> [B, Q, S] bool"""
    lanes = torch.arange(q_rows, device=seq_len.device)
    limit = seq_len[:, None] - q_rows + lanes[None, :]                      # [B, Q]
    rows = torch.arange(max_len, device=seq_len.device)
    return rows[None, None, :] <= limit[:, :, None]


def masked_attention_reference(
    q: torch.Tensor,          # [B, Hq, Q, D]
    k: torch.Tensor,          # [B, Hkv, S, D]
    v: torch.Tensor,          # [B, Hkv, S, D]
    visible: torch.Tensor,    # [B, Hkv or 1, Q, S] bool: which rows each lane (and KV head group) attends to
    scale: float,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Softmax attention restricted to `visible`, computed in `compute_dtype`. A lane that sees no row gets 0."""
    B, Hq, Q, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    qg = q.to(compute_dtype).reshape(B, Hkv, G, Q, D)
    scores = torch.einsum("bhgqd,bhsd->bhgqs", qg, k.to(compute_dtype)) * scale   # [B, Hkv, G, Q, S]
    scores = scores.masked_fill(~visible[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)                           # empty rows -> 0
    seen = visible.any(dim=2)[..., None]                                            # [B, Hkv or 1, S, 1]
    v = v.to(compute_dtype).masked_fill(~seen, 0.0)                                  # unwritten rows may be NaN
    out = torch.einsum("bhgqs,bhsd->bhgqd", probs, v)
    return out.reshape(B, Hq, Q, D)


def decode_attention_reference(
    q: torch.Tensor,                  # [B, Hq, Q, D]
    k_cache: torch.Tensor,            # [B, Hkv, S_max, D]
    v_cache: torch.Tensor,            # [B, Hkv, S_max, D]
    seq_len: torch.Tensor,            # [B] int64, rows valid including the Q new ones
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """-> [B, Hq, Q, D] in q's dtype. Reads only the first max(seq_len) rows of the cache.

    Lane by lane, each over the cache rows a one-row step of its length reads: a [Q, S] product
    moves a lane's last bits with Q, and on the CPU a verify lane must equal its decode step
    bitwise (as the kernel's lanes do by construction)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    QR = q.shape[2]
    lanes = []
    for i in range(QR):
        lane_len = seq_len - (QR - 1 - i)                         # the lane as a one-row step's seq_len
        rows = max(1, int(lane_len.max()))                        # host sync: the reference is not for graphs
        visible = causal_visibility(lane_len, 1, rows)[:, None]   # [B, 1, 1, S]
        lanes.append(masked_attention_reference(q[:, :, i : i + 1], k_cache[:, :, :rows], v_cache[:, :, :rows],
                                                visible, scale, compute_dtype))
    return torch.cat(lanes, dim=2).to(q.dtype)
