"""DeepSeek V4's multi-token-prediction (MTP) layer as a drafter (the seed server's DSpark).

The checkpoint's `mtp.0.*` tensors (set aside by engine.deepseek_v4.weights) are one more V4 block
with its own input and output parts (DeepSeek's inference/model.py, `MTPBlock`):

    x      = e_proj(enorm(embed(x_{t+1})))[:, :, None] + h_proj(hnorm(h_t))     [B, T, n, H]
    x      = Block(x)            attention + MoE + hyper-connections, over the MTP's own cache
    logits = lm_head(norm(hc_head(x)))       the target's embed and lm_head, its own norm and hc_head

h_t is the target's last-layer streams at position t ([n, H], before the head's collapse). The row
lives at position t of the MTP's cache and its logits guess x_{t+2}. Drafts after the first read
the MTP's own output streams in place of h (the chaining vLLM and SGLang use for k > 1).

The drafting cycle of one sequence (`MTPDrafter`, driven by engine.deepseek_v4.batch):
1. `observe`: the target computed positions [s, e) (a prompt chunk, a replay, or the accepted rows
   of a verify); their streams are queued, and every queued row whose next token is known is run
   through the MTP at once (its catch-up). After the sequence's last token x_C is known, the MTP's
   row at C - 1 has been run, and its logits are the first draft.
2. `propose`: width - 1 more rows at positions C, C + 1, ... chained on the MTP's own streams, then
   the MTP's cache is rolled back to C: those rows were guesses, the target's streams of the
   positions it accepts replace them at the next `observe`.
So the MTP's cache, like the target's, holds exactly the positions below its length, and a
rejection costs a length move (every kind of V4 cache rolls back that way: engine.deepseek_v4.cache).
`observe_many` and `propose_many` run the same cycle for several sequences at once: their rows
share forwards of up to ROW_STEP rows (`MTPLayer.forward_rows`), each row's bits its own forward's.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Optional

import torch
from torch import nn

from batchd.engine.deepseek_v4.cache import V4Cache
from batchd.engine.deepseek_v4.config import CSA, HCA, SLIDING, V4Config
from batchd.engine.deepseek_v4.hyper_connections import HyperHead
from batchd.engine.deepseek_v4.model import Block, DeepseekV4, allocate
from batchd.engine.deepseek_v4.norms import RMSNorm
from batchd.engine.deepseek_v4.rows import RowLinear, row_step_groups, segment_positions
from batchd.engine.deepseek_v4.weights import Renamed, canonical_name, load_tensors
from batchd.engine.sampling import Sampler

# the MTP block's own parts (checkpoint names after `mtp.0.`); everything else is its V4 block
OWN_PARTS = ("e_proj.", "h_proj.", "enorm.", "hnorm.", "norm.", "hc_head_fn", "hc_head_base", "hc_head_scale")
MAX_ADAPTIVE_WIDTH = 4   # the layer was trained one token ahead; chained drafts fade fast


class MTPLayer(nn.Module):
    """Parameters as the model's: e_proj, h_proj [H, H], enorm, hnorm, norm [H], hc_head (HyperHead),
    layers.0 (a V4 Block of `config`, a one-layer config of the MTP block's kind)."""

    def __init__(self, config: V4Config):
        super().__init__()
        H = config.hidden_size
        self.config = config
        self.e_proj = RowLinear(H, H, bias=False)
        self.h_proj = RowLinear(H, H, bias=False)
        self.enorm = RMSNorm(H, config.rms_norm_eps)
        self.hnorm = RMSNorm(H, config.rms_norm_eps)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.hc_head = HyperHead(config)
        self.layers = nn.ModuleList([Block(config, 0)])

    @property
    def device(self) -> torch.device:
        return self.e_proj.weight.device

    def new_cache(self, max_len: int, device=None) -> V4Cache:
        """Its own cache (`device` "meta": only its size, `nbytes`)."""
        return V4Cache(self.config, max_len, device or self.device, self.e_proj.weight.dtype)

    @torch.inference_mode()
    def forward(self, target: DeepseekV4, hidden: torch.Tensor, next_tokens: torch.Tensor,
                cache: V4Cache) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, T, n, H]: streams (the target's, or this layer's own) at positions
        [cache.length, + T); next_tokens [B, T]: the token after each position -> (this layer's
        streams [B, T, n, H], logits of the last row [B, V] float32, its guess two tokens ahead)."""
        B, T = next_tokens.shape
        start = cache.length
        cache.reserve(T)
        target.setup_rope(cache.max_len)
        positions = torch.arange(start, start + T, device=next_tokens.device)
        embedded = self.e_proj(self.enorm(target.embed_tokens(next_tokens)))                 # [B, T, H]
        x = embedded.unsqueeze(2) + self.h_proj(self.hnorm(hidden))                         # [B, T, n, H]
        block = self.layers[0]
        x = block(x, next_tokens, positions, cache.layers[0], start, target.rope[block.rope_family])
        cache.advance(T)
        return x, target.lm_head(self.norm(self.hc_head(x[:, -1:]))).float()[:, -1]

    @torch.inference_mode()
    def forward_rows(self, target: DeepseekV4, hidden: torch.Tensor, next_tokens: torch.Tensor,
                     caches: list[V4Cache], counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The next counts[b] rows of each of several sequences' caches in one forward
        (DeepseekV4.hidden_rows' way): hidden [1, N, n, H] (sequence after sequence, N =
        sum(counts), each sequence's rows from its cache's length on), next_tokens [1, N] ->
        (streams [1, N, n, H], logits [B, V] float32 of each sequence's last row). N <= ROW_STEP
        keeps each row's bits those of `forward` on its own sequence's rows (engine.deepseek_v4.rows)."""
        starts = [cache.length for cache in caches]
        for cache, count in zip(caches, counts):
            cache.reserve(count)
        target.setup_rope(max(cache.max_len for cache in caches))
        positions = segment_positions(starts, counts, next_tokens.device)
        embedded = self.e_proj(self.enorm(target.embed_tokens(next_tokens)))                 # [1, N, H]
        x = embedded.unsqueeze(2) + self.h_proj(self.hnorm(hidden))                         # [1, N, n, H]
        block = self.layers[0]
        segments = [(cache.layers[0], start, count) for cache, start, count in zip(caches, starts, counts)]
        x = block.forward_rows(x, next_tokens, positions, segments, target.rope[block.rope_family])
        for cache, count in zip(caches, counts):
            cache.advance(count)
        last = torch.tensor(list(accumulate(counts)), device=x.device) - 1                 # [B]
        return x, target.lm_head(self.norm(self.hc_head(x[:, last]))).float()[0]


def mtp_names(tensors: Mapping[str, torch.Tensor], index: int = 0) -> Renamed:
    """`mtp.{index}.*` checkpoint tensors -> MTPLayer's checkpoint-style names: its own parts at
    the top (`hc_head_fn`, `enorm.weight`, ...), the block's under `layers.0.` (engine.deepseek_v4.weights
    maps both onto the parameters). A view: nothing is read here."""
    prefix, names = f"mtp.{index}.", {}
    for name in tensors:
        if name.startswith(prefix):
            rest = name[len(prefix):]
            names[rest if rest.startswith(OWN_PARTS) else "layers.0." + rest] = name
    return Renamed(tensors, names)


def mtp_config(target: V4Config, canonical: set[str]) -> V4Config:
    """The one-layer config of the MTP block, its kinds read from which tensors it has (V4-Flash's
    has no compressor: a sliding-window layer with a learned router)."""
    attn = "layers.0.self_attn.compressor."
    if any(name.startswith(attn + "indexer.") for name in canonical):
        kind = CSA
    elif any(name.startswith(attn) for name in canonical):
        kind = HCA
    else:
        kind = SLIDING
    mlp = "hash_moe" if "layers.0.mlp.gate.tid2eid" in canonical else "moe"
    return replace(target, num_layers=1, layer_types=[kind], mlp_layer_types=[mlp])


def build_mtp(target: DeepseekV4, tensors: Mapping[str, torch.Tensor], source: str = "checkpoint") -> Optional[MTPLayer]:
    """The MTP layer from a checkpoint's set-aside `mtp.*` tensors (SetAside.mtp), on the target's
    device and dtype (its norms and hyper-connection parts in float32, as the target's); None if
    the checkpoint has none. A checkpoint with several keeps the first (V4 ships one)."""
    renamed = mtp_names(tensors)
    if not renamed:
        return None
    config = mtp_config(target.config, {canonical_name(name) for name in renamed})
    with torch.device("meta"):
        layer = MTPLayer(config)
    allocate(layer, target.device, target.dtype)
    load_tensors(layer, renamed, f"{source} (its MTP layer, mtp.0.*)")
    return layer.eval().requires_grad_(False)


def draft_cost(config: V4Config) -> float:
    """One MTP row relative to a target step (one block and the head against all of the target's
    blocks and the head; the head counted as one block): the adaptive width's cost per draft."""
    return 2.0 / (config.num_layers + 2)


@dataclass
class MTPState:
    """One sequence's MTP: its cache (positions [0, cache.length) hold rows made from the target's
    streams) and the target's streams of the positions after it, waiting for their next token."""

    cache: V4Cache
    pending: list[torch.Tensor] = field(default_factory=list)   # [T_i, n, H] each, in position order
    logits: Optional[torch.Tensor] = None    # [V]: the row at cache.length - 1 guessing x_{length + 1}
    streams: Optional[torch.Tensor] = None   # [1, 1, n, H]: that row's output, which draft 2 reads
    probs: Optional[torch.Tensor] = None     # [k, V]: the latest sampled drafts' distributions (None: greedy)
    preemptions: int = 0                     # the sequence's preemption count this state holds for

    @property
    def end(self) -> int:
        """The first position neither in the cache nor pending."""
        return self.cache.length + sum(rows.shape[0] for rows in self.pending)

    def reset(self) -> None:
        """Forget everything (the target's rows were dropped too: a preemption)."""
        self.cache.reset()
        self.pending, self.logits, self.streams = [], None, None


@dataclass
class _Lane:
    """One sequence's drafting in `MTPDrafter.propose_many`."""

    index: int                          # its place in the requests
    state: MTPState
    context: int                        # C: the position of the sequence's last token
    width: int
    sampler: Optional[Sampler]          # None: greedy drafts
    logits: torch.Tensor                # [V]: the guess the next draft is taken from
    streams: torch.Tensor               # [1, 1, n, H]: the row that guess came from, which the next row reads
    drafts: list[torch.Tensor] = field(default_factory=list)   # [1, 1] each, on the device
    probs: list[torch.Tensor] = field(default_factory=list)    # [V] each, sampled drafts' distributions


class MTPDrafter:
    """Drafts for many sequences of one target with its MTP layer, one MTPState each."""

    def __init__(self, target: DeepseekV4, layer: MTPLayer):
        self.target, self.layer = target, layer

    def new_state(self, max_len: int) -> MTPState:
        return MTPState(self.layer.new_cache(max_len))

    def observe(self, state: MTPState, start: int, streams: torch.Tensor, tokens: list[int]) -> None:
        """`observe_many` for one sequence."""
        self.observe_many([(state, start, streams, tokens)])

    def observe_many(self, items: list[tuple[MTPState, int, torch.Tensor, list[int]]]) -> None:
        """For each (state, start, streams, tokens): the target computed positions [start, start + T)
        of that sequence, streams [T, n, H]; `tokens` are the sequence's tokens known now (prompt
        and generated). Rows whose next token is among them are run at once: the sequences' rows
        share forwards of up to ROW_STEP rows (`_catch_up_many`)."""
        for state, start, streams, tokens in items:
            if start < state.end:
                self._rewind(state, start)
            elif start > state.end:
                # a prompt head shared from another sequence (prefix sharing): the target did not
                # compute it here, so it has no streams; the MTP's rows there stay zero (weaker drafts
                # until its window has passed them; the target's output does not depend on drafts)
                self._catch_up_many([(state, tokens)])
                state.pending, state.logits, state.streams = [], None, None
                state.cache.reserve(start - state.cache.length)
                state.cache.advance(start - state.cache.length)
            state.pending.append(streams)
        self._catch_up_many([(state, tokens) for state, _, _, tokens in items])

    def propose(self, state: MTPState, tokens: list[int], width: int, sampler: Optional[Sampler] = None) -> list[int]:
        """`propose_many` for one sequence."""
        return self.propose_many([(state, tokens, width, sampler)])[0]

    def propose_many(self, requests: list[tuple[MTPState, list[int], int, Optional[Sampler]]]) -> list[list[int]]:
        """Drafts for several sequences: for each (state, tokens, width, sampler), up to `width`
        tokens after `tokens` (whose last one, at position C = len(tokens) - 1, the target computes
        next); each MTP cache is left at length C. Draft 1 is the catch-up row's guess; draft i + 1
        of every sequence still drafting is one row of one forward per ROW_STEP sequences
        (`MTPLayer.forward_rows`), chained on the MTP's own streams. Greedy (the MTP's argmax), or
        drawn from the MTP's distribution filtered by a sampling job's `sampler`, which
        `state.probs` keeps for rejection sampling. One host sync for all of them."""
        self._catch_up_many([(state, tokens) for state, tokens, _, _ in requests])
        lanes = []
        for index, (state, tokens, width, sampler) in enumerate(requests):
            state.probs = None
            if width >= 1 and state.logits is not None and state.cache.length == len(tokens) - 1:
                lanes.append(_Lane(index, state, len(tokens) - 1, width,
                                   sampler if sampler is not None and not sampler.greedy else None,
                                   state.logits, state.streams))
        for i in range(max((lane.width for lane in lanes), default=0)):
            drafting = [lane for lane in lanes if lane.width > i]
            for group in row_step_groups(drafting, lambda lane: 1) if i else []:   # draft 1: the catch-up's guess
                streams, logits = self.layer.forward_rows(
                    self.target, torch.cat([lane.streams for lane in group], dim=1),
                    torch.cat([lane.drafts[-1] for lane in group], dim=1), [lane.state.cache for lane in group],
                    [1] * len(group))
                for j, lane in enumerate(group):
                    lane.logits, lane.streams = logits[j], streams[:, j : j + 1]
            for lane in drafting:
                if lane.sampler is not None:
                    lane.probs.append(lane.sampler.probabilities(lane.logits))                   # [V]
                    lane.drafts.append(lane.sampler.draw(lane.probs[-1]).view(1, 1))
                else:
                    lane.drafts.append(lane.logits.argmax().view(1, 1))
        out: list[list[int]] = [[] for _ in requests]
        if lanes:
            flat = torch.cat([d for lane in lanes for d in lane.drafts], dim=1)[0].tolist()   # the one sync
            for lane in lanes:
                out[lane.index], flat = flat[: lane.width], flat[lane.width :]
                lane.state.cache.truncate(lane.context)   # the chained rows were guesses; the target's replace them
                lane.state.probs = torch.stack(lane.probs) if lane.sampler is not None else None
        return out

    def _catch_up_many(self, items: list[tuple[MTPState, list[int]]]) -> None:
        """Run each state's pending rows whose next token is known (all of them but, after a prompt's
        last chunk, the last one until its token is sampled). A sequence's rows are one forward
        with those of the sequences beside it while they are at most ROW_STEP rows together (so
        every row's bits are its own forward's); more rows (a prompt chunk) run alone."""
        ready = []   # (state, rows [n, n_hc, H], next tokens)
        for state, tokens in items:
            if not state.pending:
                continue
            start = state.cache.length
            rows = torch.cat(state.pending) if len(state.pending) > 1 else state.pending[0]   # [P, n, H]
            n = min(rows.shape[0], len(tokens) - 1 - start)
            if n <= 0:
                state.pending = [rows]
                continue
            state.pending = [rows[n:]] if n < rows.shape[0] else []
            ready.append((state, rows[:n], tokens[start + 1 : start + 1 + n]))
        for group in row_step_groups(ready, lambda item: len(item[2])):
            ids = torch.tensor([[t for _, _, next_tokens in group for t in next_tokens]], device=self.layer.device)
            out, logits = self.layer.forward_rows(self.target, torch.cat([rows for _, rows, _ in group])[None], ids,
                                                  [state.cache for state, _, _ in group],
                                                  [len(next_tokens) for _, _, next_tokens in group])
            last = -1
            for b, (state, _, next_tokens) in enumerate(group):
                last += len(next_tokens)
                state.logits, state.streams = logits[b], out[:, last : last + 1]

    @staticmethod
    def _rewind(state: MTPState, position: int) -> None:
        """Forget positions from `position` on (pending and cached)."""
        if position >= state.cache.length:
            keep = position - state.cache.length
            rows = torch.cat(state.pending) if state.pending else None
            state.pending = [rows[:keep]] if rows is not None and keep else []
        else:
            state.pending = []
            state.cache.truncate(position)
            state.logits = state.streams = None
