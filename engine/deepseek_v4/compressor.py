"""The compressed-KV branches of CSA and HCA layers, and CSA's lightning indexer (paper §2.3).

A compressor projects every position to a key/value series C and a gate series Z (C = Z = one
head_dim wide for HCA; two for CSA, whose entries overlap: series Ca of window w - 1 and Cb of
window w). When window w = positions [w m, (w + 1) m) is complete, it emits one entry:

    entry_w = rope_at(w m)(kv_norm(sum_j softmax_j(Z_j + B_j) C_j))       (per channel, over the slots)

with B the learned per-slot `position_bias`. The projections live in the cache (engine.deepseek_v4.cache)
by position, so an entry is computed from them whenever its window closes, in a step or after a
rollback alike. CSA's indexer compresses the same windows at index_head_dim and scores each query
against the entries (`∑_h w_h ReLU(q_h · K)`), keeping the top `index_topk` that the query may see.
A step of up to 17 rows (engine.deepseek_v4.rows) closes its windows one at a time and scores and
picks each query's entries on its own, so a verify row's choice is its decode row's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchd.engine.deepseek_v4.cache import CompressorState
from batchd.engine.deepseek_v4.config import V4Config
from batchd.engine.deepseek_v4.norms import RMSNorm
from batchd.engine.deepseek_v4.rope import RopeTable, apply_rope
from batchd.engine.deepseek_v4.rows import RowLinear, is_row_step


class Compressor(nn.Module):
    """One series of compressed entries of `entry_dim` channels every `rate` positions;
    `overlap` (CSA): two series per position, each entry spanning two windows."""

    def __init__(self, hidden_size: int, entry_dim: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        width = 2 * entry_dim if overlap else entry_dim
        self.entry_dim, self.rate, self.overlap = entry_dim, rate, overlap
        self.kv_proj = RowLinear(hidden_size, width, bias=False)
        self.gate_proj = RowLinear(hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width))
        self.kv_norm = RMSNorm(entry_dim, eps)

    def store(self, hidden: torch.Tensor, state: CompressorState, start: int) -> None:
        """hidden [B, T, H] at positions [start, start + T) -> their projections into `state`."""
        state.kv.write(start, self.kv_proj(hidden))
        state.gate.write(start, self.gate_proj(hidden))

    def close_windows(self, state: CompressorState, start: int, end: int, rope: RopeTable) -> int:
        """Write the entries of every window that closes within positions [start, end);
        -> the number of entries valid at `end`."""
        first, last = start // self.rate, end // self.rate
        if last > first and is_row_step(end - start):   # one window a call, as a decode step closes it
            for w in range(first, last):
                state.entries.write(w, self.entries(state, w, w + 1, rope))
        elif last > first:
            state.entries.write(first, self.entries(state, first, last, rope))
        return last

    def entries(self, state: CompressorState, first: int, last: int, rope: RopeTable) -> torch.Tensor:
        """Entries of windows [first, last) -> [B, last - first, entry_dim]."""
        m, n = self.rate, last - first
        kv = state.kv.read(first * m, last * m).unflatten(1, (n, m))                         # [B, n, m, C]
        gate = state.gate.read(first * m, last * m).unflatten(1, (n, m)) + self.position_bias
        if self.overlap:
            kv, gate = self._overlapping_slots(state, kv, gate, first)                       # [B, n, 2m, d]
        pooled = (kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2)     # [B, n, d]
        positions = torch.arange(first, last, device=kv.device) * m
        cos, sin = rope.at(positions)                                                        # [n, rope/2]
        return apply_rope(self.kv_norm(pooled), cos, sin)

    def _overlapping_slots(self, state, kv, gate, first):
        """CSA's 2m slots per entry: series Ca of the window before (zero value, -inf gate before
        the first window), then series Cb of the window itself."""
        m, d = self.rate, self.entry_dim
        B, n = kv.shape[:2]
        slots_kv = kv.new_zeros(B, n, 2 * m, d)
        slots_gate = gate.new_full((B, n, 2 * m, d), float("-inf"))
        slots_kv[:, :, m:], slots_gate[:, :, m:] = kv[..., d:], gate[..., d:]
        slots_kv[:, 1:, :m], slots_gate[:, 1:, :m] = kv[:, :-1, :, :d], gate[:, :-1, :, :d]
        if first > 0:  # the window before this step's first: from the stored projections
            slots_kv[:, 0, :m] = state.kv.read((first - 1) * m, first * m)[..., :d]
            slots_gate[:, 0, :m] = state.gate.read((first - 1) * m, first * m)[..., :d] + self.position_bias[:, :d]
        return slots_kv, slots_gate


class Indexer(Compressor):
    """CSA's lightning indexer: an overlapping compressor of its own at index_head_dim, whose
    entries it scores against per-head queries from the attention's q_residual."""

    def __init__(self, config: V4Config, rate: int):
        super().__init__(config.hidden_size, config.index_head_dim, rate, True, config.rms_norm_eps)
        self.num_heads, self.head_dim, self.top_k = config.index_n_heads, config.index_head_dim, config.index_topk
        self.q_b_proj = RowLinear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.weights_proj = RowLinear(config.hidden_size, self.num_heads, bias=False)

    def select(self, hidden, q_residual, positions, entries, rope: RopeTable, start: int):
        """Which entries each query attends to: the top `index_topk` by score among the entries whose
        window ended at or before the query. hidden [B, T, H], q_residual [B, T, R], positions [T]
        = [start, start + T), entries [B, n, Di] -> [B, T, n] bool; in a row step the picks of each
        row ([B][T] ascending indices, None where no entry is visible yet)."""
        B, T, _ = hidden.shape
        n = entries.shape[1]
        cos, sin = rope.at(positions)                                                  # [T, rope/2]
        q = self.q_b_proj(q_residual).view(B, T, self.num_heads, self.head_dim)
        q = apply_rope(q, cos[:, None], sin[:, None])                                  # [B, T, Hi, Di]
        weights = self.weights_proj(hidden).float() * self.num_heads**-0.5             # [B, T, Hi]
        if is_row_step(B * T):
            return self._select_rows(q, weights, start, entries)
        scores = torch.matmul(q.float(), entries.float().transpose(-1, -2).unsqueeze(1))   # [B, T, Hi, n]
        scores = F.relu(scores) * self.head_dim**-0.5
        scores = (scores * weights.unsqueeze(-1)).sum(dim=2)                          # [B, T, n]
        visible = visible_entries(positions, n, self.rate)                 # [T, n]
        scores = scores.masked_fill(~visible, float("-inf"))
        # the same top-k as transformers (ties broken alike); picks past what a query may see
        # (an early query with fewer visible entries than k) are dropped
        picks = scores.topk(min(self.top_k, n), dim=-1).indices                       # [B, T, k]
        chosen = torch.zeros(B, T, n, dtype=torch.bool, device=hidden.device)
        chosen.scatter_(-1, picks, True)
        return chosen & visible

    def _select_rows(self, q, weights, start: int, entries) -> list[list]:
        """`select` of a row step: each query scored against exactly the entries it may see, alone
        (its decode step's candidate list). q [B, T, Hi, Di], weights [B, T, Hi] -> [B][T] ascending
        indices of its picks (None: none visible); the host knows how many each row sees, so
        nothing is read back."""
        B, T = q.shape[:2]
        picks = [[None] * T for _ in range(B)]
        for i in range(T):
            seen = (start + i + 1) // self.rate
            if seen == 0:
                continue
            for b in range(B):
                row = q[b, i].to(torch.float32, copy=True)                  # its own buffer, as a decode row's
                scores = F.relu(row @ entries[b, :seen].float().T) * self.head_dim**-0.5                 # [Hi, seen]
                scores = (scores * weights[b, i, :, None]).sum(dim=0)                                  # [seen]
                picks[b][i] = scores.topk(min(self.top_k, seen)).indices.sort().values
        return picks


def visible_entries(positions: torch.Tensor, n: int, rate: int) -> torch.Tensor:
    """positions [T] -> [T, n] bool: entry w is visible to the query at t once its window is
    complete, (w + 1) rate <= t + 1."""
    return torch.arange(n, device=positions.device)[None] < ((positions + 1) // rate)[:, None]
