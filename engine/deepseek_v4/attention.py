"""V4 attention (paper §2.3): shared-KV multi-query attention over a sliding window, plus, in CSA
and HCA layers, compressed entries; one learned sink logit per head.

    q   = rope(rmsnorm_per_head(q_b(q_a_norm(q_a(x)))))        [B, T, Hq, D]
    kv  = rope(kv_norm(kv_proj(x)))                             [B, T, D]     one row, key = value
    out = softmax([q·K | sink]) V over K = V = window rows ++ compressed entries
    out = rope at -position (undo the value rows' rotation), then the grouped output projection

Which keys a query at position t sees: window rows (t - sliding_window, t]; HCA: every entry whose
window ended by t; CSA: the indexer's top-k of those. The mask is built per query from positions,
so a prefill chunk, a decode row and q verify rows all follow the same rule. A step of up to 17
rows (engine.deepseek_v4.rows) attends row by row over exactly the keys each row sees, and runs the
grouped projection group by group through the row-invariant linear, so a verify row's bits are its
decode row's.
"""
from __future__ import annotations

import torch
from torch import nn

from batchd.engine.deepseek_v4.cache import LayerCache
from batchd.engine.deepseek_v4.compressor import Compressor, Indexer, visible_entries
from batchd.engine.deepseek_v4.config import CSA, SLIDING, V4Config
from batchd.engine.deepseek_v4.norms import RMSNorm, unweighted_rms_norm
from batchd.engine.deepseek_v4.rope import RopeTable, apply_rope
from batchd.engine.deepseek_v4.rows import RowLinear, is_row_step, linear, padded_rows


class GroupedLinear(nn.Module):
    """The grouped output projection's first half: heads split into `groups`, each group's
    [Hq D / g] slice projected to its own `rank` outputs. weight: [g rank, Hq D / g]."""

    def __init__(self, in_per_group: int, out_features: int, groups: int):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, g, in] -> [B, T, g rank]."""
        w = self.weight.view(self.groups, -1, x.shape[-1])                         # [g, rank, in]
        B, T, g, _ = x.shape
        if not is_row_step(B * T):
            return torch.einsum("btgi,gri->btgr", x, w).flatten(2)
        if x.is_cuda:  # a row step: every group at once over CUDA_ROW_SLAB rows (one shape: rows.padded_rows)
            out = torch.bmm(padded_rows(x.reshape(B * T, g, -1)).transpose(0, 1), w.transpose(1, 2))  # [g, slab, rank]
            return out.transpose(0, 1)[: B * T].reshape(B, T, -1)
        # each group's slice as one row-invariant projection [B, T, in] -> [B, T, rank]
        return torch.cat([linear(x[:, :, i].contiguous(), w[i]) for i in range(g)], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: V4Config, layer: int):
        super().__init__()
        self.kind = config.layer_types[layer]
        self.num_heads, self.head_dim, self.window = config.num_heads, config.head_dim, config.sliding_window
        self.eps, self.scale = config.rms_norm_eps, config.head_dim**-0.5
        self.q_a_proj = RowLinear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = RowLinear(config.q_lora_rank, config.num_heads * config.head_dim, bias=False)
        self.kv_proj = RowLinear(config.hidden_size, config.head_dim, bias=False)
        self.kv_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.o_a_proj = GroupedLinear(config.num_heads * config.head_dim // config.o_groups,
                                      config.o_groups * config.o_lora_rank, config.o_groups)
        self.o_b_proj = RowLinear(config.o_groups * config.o_lora_rank, config.hidden_size, bias=False)
        self.o_groups = config.o_groups
        self.sinks = nn.Parameter(torch.zeros(config.num_heads))
        self.compressor = None
        if self.kind != SLIDING:
            rate = config.compress_rate(layer)
            self.compressor = Compressor(config.hidden_size, config.head_dim, rate, self.kind == CSA, config.rms_norm_eps)
            if self.kind == CSA:
                self.compressor.indexer = Indexer(config, rate)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: LayerCache, start: int,
                rope: RopeTable) -> torch.Tensor:
        """x: the normed block input [B, T, H] at positions [start, start + T) (`positions` [T]);
        writes this step's rows into `cache` -> [B, T, H]. `rope`: the layer's family (main for
        sliding layers, compress for CSA/HCA)."""
        B, T, _ = x.shape
        cos, sin = rope.at(positions)                                                  # [T, rope/2]
        q, q_residual, kv = self._project(x, cos[:, None], sin[:, None], cos, sin)
        out = self._attend(x, q, q_residual, kv, positions, cache, start, rope)
        return self._output(out, cos[:, None], sin[:, None])

    def forward_rows(self, x: torch.Tensor, positions: torch.Tensor, segments: list[tuple[LayerCache, int, int]],
                     rope: RopeTable) -> torch.Tensor:
        """The rows of several sequences in one step: x [1, N, H], rows laid out sequence after
        sequence; segments: (its cache, start, rows) each, positions [N] -> [1, N, H]. Projections,
        norms and rope run over all N rows (the row step's invariant path, as a verify's rows);
        each sequence's cache, compressor and attention on its own rows, exactly as its own step
        of those rows computes them."""
        cos, sin = rope.at(positions)                                                  # [N, rope/2]
        q, q_residual, kv = self._project(x, cos[:, None], sin[:, None], cos, sin)
        parts, first = [], 0
        for cache, start, rows in segments:
            end = first + rows
            parts.append(self._attend(x[:, first:end], q[:, first:end], q_residual[:, first:end], kv[:, first:end],
                                      positions[first:end], cache, start, rope))
            first = end
        return self._output(torch.cat(parts, dim=1), cos[:, None], sin[:, None])

    def _project(self, x, q_cos, q_sin, kv_cos, kv_sin):
        """-> (rotated q [B, T, Hq, D], q_residual [B, T, R], rotated kv row [B, T, D]); the cos and
        sin broadcast over q [B, T, Hq, rope/2] and kv [B, T, rope/2]."""
        B, T, _ = x.shape
        q_residual = self.q_a_norm(self.q_a_proj(x))                                   # [B, T, R]
        q = self.q_b_proj(q_residual).view(B, T, self.num_heads, self.head_dim)
        q = apply_rope(unweighted_rms_norm(q, self.eps), q_cos, q_sin)                 # [B, T, Hq, D]
        return q, q_residual, apply_rope(self.kv_norm(self.kv_proj(x)), kv_cos, kv_sin)

    def _attend(self, x, q, q_residual, kv, positions, cache: LayerCache, start: int, rope) -> torch.Tensor:
        """Write the step's kv rows at [start, start + T) of `cache` and attend -> [B, T, Hq, D]."""
        B, T, _ = x.shape
        end = start + T
        cache.rows.write(start, kv)
        first = max(0, start - self.window + 1)  # the oldest row any query of this step sees
        keys = cache.rows.read(first, end).to(x.dtype)                                 # [B, L, D]
        entries = entry_mask = None
        if self.compressor is not None:
            entries, entry_mask = self._compressed(x, q_residual, positions, cache, start, end, rope)
            entries = entries.to(x.dtype)                                              # [B, n, D], [B, T, n]
        if is_row_step(B * T):  # (entry_mask here: the CSA rows' picks, or None)
            return self._attend_rows(q, keys, first, start, entries, entry_mask)
        key_pos = torch.arange(first, end, device=x.device)
        in_window = (key_pos[None] <= positions[:, None]) & (key_pos[None] > positions[:, None] - self.window)
        mask = in_window.expand(B, T, -1)                                              # [B, T, L]
        if entries is not None:
            keys = torch.cat([keys, entries], dim=1)                                   # [B, L + n, D]
            mask = torch.cat([mask, entry_mask], dim=-1)
        return attend_with_sinks(q, keys, mask, self.sinks, self.scale)                # [B, T, Hq, D]

    def _output(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """out [B, T, Hq, D] -> [B, T, H]: rotated back (K = V carried rope: by -t), then the grouped
        output projection."""
        B, T = out.shape[:2]
        out = apply_rope(out, cos, -sin)
        return self.o_b_proj(self.o_a_proj(out.reshape(B, T, self.o_groups, -1)))

    def _attend_rows(self, q, keys, first, start, entries, picks) -> torch.Tensor:
        """A row step's attention, each query row as its own call over exactly the keys it sees (its
        window's rows, then its visible, in CSA chosen, entries in index order), as its decode step
        computes it. q [B, T, Hq, D], keys [B, L, D] from position `first`, entries [B, n, D] or
        None; picks: a CSA layer's chosen entries of each row ([B][T] ascending indices, None where
        none is visible: Indexer.select), None in an HCA layer (a row sees every entry whose window
        ended by it). Nothing is read back to the host. -> [B, T, Hq, D]."""
        B, T = q.shape[:2]
        out = torch.empty_like(q)
        for b in range(B):
            for i in range(T):
                t = start + i
                row_keys = keys[b, max(first, t - self.window + 1) - first : t + 1 - first]
                if entries is None:
                    row_keys = row_keys.clone()   # its own (aligned) buffer, as a decode row's   [K, D]
                else:  # concatenated: a buffer of its own too
                    if picks is None:
                        seen = entries[b, : (t + 1) // self.compressor.rate]
                    else:
                        seen = entries[b, :0] if picks[b][i] is None else entries[b].index_select(0, picks[b][i])
                    row_keys = torch.cat([row_keys, seen])
                out[b, i] = attend_with_sinks(q[b, i].clone()[None, None], row_keys[None], None, self.sinks,
                                              self.scale)[0, 0]
        return out

    def _compressed(self, x, q_residual, positions, cache: LayerCache, start, end, rope):
        """Store the step's compressor projections, close the windows that completed, and say
        which entries each query sees -> (entries [B, n, D], mask [B, T, n]); in a row step the
        mask is None in HCA (every visible entry) and the indexer's picks in CSA (Indexer.select)."""
        compressor = self.compressor
        compressor.store(x, cache.compressor, start)
        n = compressor.close_windows(cache.compressor, start, end, rope)
        entries = cache.compressor.entries.read(0, n)
        row_step = is_row_step(x.shape[0] * x.shape[1])
        if self.kind != CSA:
            return entries, None if row_step else visible_entries(positions, n, compressor.rate).expand(x.shape[0], -1, -1)
        indexer = compressor.indexer
        indexer.store(x, cache.indexer, start)
        indexer.close_windows(cache.indexer, start, end, rope)
        chosen = indexer.select(x, q_residual, positions, cache.indexer.entries.read(0, n), rope, start)
        return entries, chosen


def attend_with_sinks(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Multi-query attention with one sink logit per head (probability mass that goes nowhere).
    q [B, T, Hq, D], keys (= values) [B, K, D], mask [B, T, K] bool or None, sinks [Hq] -> [B, T, Hq, D]."""
    logits = torch.einsum("bthd,bkd->bhtk", q, keys) * scale                      # [B, Hq, T, K]
    if mask is not None:   # None: every key
        logits = logits.masked_fill(~mask[:, None], float("-inf"))
    sink = sinks.to(logits.dtype)[None, :, None, None].expand(*logits.shape[:3], 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = combined.softmax(dim=-1)[..., :-1]                                     # the sink dropped
    return torch.einsum("bhtk,bkd->bthd", probs.to(keys.dtype), keys)
