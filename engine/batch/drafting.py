"""Draft-model proposals inside the batch engine: one drafter drafts for all its sequences at once.

    drafter = PooledDrafter(name, draft_model, num_blocks=..., block_size=..., ...)
    drafter.catch_up([(seq, start, end), ...])         # positions the target computed, as chunks
    drafts = drafter.propose([(seq, state, width), ...])   # k row passes -> width tokens each

A drafter (engine.speculative.drafters.DraftModel: its own model, or a view of the target's) gets
a paged pool of its own with the target's block count and block size, so a sequence's block table
addresses both pools: position p lives in block table[p // block_size] of either. Nothing is
copied between them and the scheduler allocates for both at once.

Per step of the batch engine (engine.batch.batch_engine):
1. catch-up, before the plan: positions the target computed and the drafter has not, computed
   the way the target computed them: prompt positions as prompt chunks cut at multiples of the
   prefill chunk (the first through the one-sequence prefill on the drafter's own contiguous
   cache, the others over the pool: engine.batch.chunks), generated ones (a replay after
   preemption) as rows, when more than `MAX_TAIL_ROWS` of them lag;
2. proposal, after the plan reserved blocks for the drafts: pass 0 feeds each sequence's few unseen
   positions and its last token as rows (engine.batch.rows), pass i feeds draft i; greedy drafts
   are the drafter's argmax, sampled ones are drawn from its distribution, which rejection
   sampling needs (engine.speculative.verify);
3. after verification (`DraftState.verified`): the drafter keeps its rows of the accepted drafts.

So a drafter that is the target itself holds, bit for bit, the target's rows, and every draft
it makes is accepted (the test of this machinery). A rejected draft needs no rollback: the drafter's rows past `DraftState.computed` are never read
before the next write to their position overwrites them, exactly as in the target's pool. 
A prompt head shared by hash (engine.batch.block_pool) is in the drafter's pool only where a
sequence with this drafter computed it: each drafter remembers which whole prompt chunk each of
its blocks holds (by the same chained hash) and forgets it when it writes anything else there.
A shared chunk it holds is skipped; one it does not is computed into the shared blocks, writing
the rows any other sequence with this drafter would (a chunk's rows depend on its tokens and
position alone), so a neighbour reading those blocks sees no change.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from batchd.engine.batch.block_pool import chunk_hashes
from batchd.engine.batch.chunks import ChunkBatch, ChunkPacking, forward_chunks
from batchd.engine.batch.first_chunks import FirstChunkRunner
from batchd.engine.batch.graphs import RowRunner
from batchd.engine.batch.paged_cache import PagedKVCache
from batchd.engine.batch.sequence import Sequence

MAX_TAIL_ROWS = 16   # generated positions a drafter may lag and still draft: pass 0 feeds them as rows


@dataclass
class DraftState:
    """One sequence's place in its drafter's pool."""

    drafter: "PooledDrafter"
    computed: int = 0          # leading positions of the sequence whose drafter rows are in the pool
    preemptions: int = 0       # the sequence's preemption count `computed` holds for
    last_position: int = 0     # the position of the last token at the latest proposal
    width: int = 0             # drafts of the latest proposal
    probs: Optional[torch.Tensor] = None   # [width, V] the distributions they were drawn from (sampling)
    hashes: Optional[list[bytes]] = None   # chained hashes of the prompt's whole chunks (block_pool)

    def sync(self, seq: Sequence) -> None:
        """A preemption freed the sequence's blocks: its drafter rows went with them."""
        if self.preemptions != seq.preemptions:
            self.computed, self.preemptions = 0, seq.preemptions

    def lag(self, seq: Sequence) -> int:
        """Positions the target computed and the drafter has not."""
        return seq.computed - self.computed

    def verified(self, seq: Sequence) -> None:
        """The target verified the latest proposal and moved `seq.computed` past the accepted
        drafts. Drafts 1..width-1 were fed to the drafter (the last one never is), so its rows
        hold up to the last token plus min(accepted, width - 1) drafts."""
        self.computed = min(seq.computed, self.last_position + self.width)
        self.width, self.probs = 0, None


class PooledDrafter:
    """A drafter's model over a paged pool shaped like the target's."""

    def __init__(self, name: str, draft_model, *, num_blocks: int, block_size: int, dtype: torch.dtype,
                 max_context: int, chunk: int, slab_rows: Optional[int], cuda_graphs: bool,
                 packing: ChunkPacking = ChunkPacking()):
        self.name, self.draft_model = name, draft_model
        self.model = draft_model.model
        self.cache = PagedKVCache(self.model.config, num_blocks, block_size, self.model.device, dtype)
        self.rows = RowRunner(self.model, self.cache, max_context=max_context, slab_rows=slab_rows,
                              cuda_graphs=cuda_graphs)
        # the target's first-chunk path over the drafter's own contiguous cache (the DraftModel's),
        # so a target drafting for itself holds its very rows (padded and graphed alike on CUDA)
        self.first_chunks = FirstChunkRunner(self.model, draft_model.cache, self.cache, cuda_graphs=cuda_graphs)
        self.max_context, self.chunk, self.slab_rows = max_context, chunk, slab_rows
        self.packing = packing   # the target's: a prompt chunk takes the path it took for the target
        self.pass_s: Optional[float] = None   # seconds of one row pass (moving average, measured)
        self.held: dict[int, tuple[bytes, int]] = {}   # block -> (chunk hash, index in chunk) its rows are
        self.prompt_positions = 0   # prompt positions computed (a shared chunk held is not computed again)

    @property
    def checkpoint_sha256(self) -> str:
        return self.draft_model.checkpoint_sha256

    def ready(self, seq: Sequence, state: DraftState) -> bool:
        """Whether the first pass can take what the drafter lags (a few generated positions)."""
        return state.computed >= seq.prompt_len and state.lag(seq) <= MAX_TAIL_ROWS

    def pieces(self, seq: Sequence, state: DraftState) -> list[tuple[int, int]]:
        """What brings the drafter to what the target computed, as the target computed it:
        prompt chunks cut at multiples of the prefill chunk (those it holds already skipped),
        then the generated positions (rows), if more than MAX_TAIL_ROWS of them lag."""
        prompt_end = min(seq.prompt_len, seq.computed)
        self._skip_held_chunks(seq, state, prompt_end)
        out, start = [], state.computed
        while start < prompt_end:
            end = min(prompt_end, (start // self.chunk + 1) * self.chunk)
            out.append((start, end))
            start = end
        if start >= seq.prompt_len and seq.computed - start > MAX_TAIL_ROWS:
            out.append((start, seq.computed))
        return out

    def _skip_held_chunks(self, seq: Sequence, state: DraftState, end: int) -> None:
        """Move `state.computed` past the whole prompt chunks whose rows the pool holds already
        in this sequence's blocks (a shared head another sequence with this drafter computed)."""
        if state.hashes is None:
            state.hashes = chunk_hashes(seq.prompt_ids, self.chunk, seq.prompt_len - 1)
        per_chunk = self.chunk // self.cache.block_size
        while state.computed % self.chunk == 0 and state.computed + self.chunk <= end:
            k = state.computed // self.chunk
            if k >= len(state.hashes) or any(self.held.get(seq.blocks[k * per_chunk + i]) != (state.hashes[k], i)
                                             for i in range(per_chunk)):
                return
            state.computed += self.chunk

    def catch_up(self, pieces: list[tuple[Sequence, DraftState, int, int]]) -> None:
        """Write the drafter's rows of positions [start, end) of each sequence (their earlier
        positions are in the pool, or earlier in `pieces`): prompt pieces in one pass of chunks,
        generated ones in one pass of rows."""
        for seq, _, start, end in pieces:
            if end <= seq.prompt_len and not self.packing.in_pass(start, end):
                self._prefill_first_chunk(seq, end)   # a long first chunk: the one-sequence prefill, as the target's
        chunks = [(seq.tokens()[start:end], start, seq.blocks) for seq, _, start, end in pieces
                  if end <= seq.prompt_len and self.packing.in_pass(start, end)]
        if chunks:
            batch = ChunkBatch.build(chunks, self.cache.block_size, self.cache.pad_block, self.model.device)
            forward_chunks(self.model, self.cache, batch, slab_rows=self.slab_rows, max_context=self.max_context,
                           chunk_slab_rows=self.packing.slab_rows)
        tokens, positions, tables = [], [], []
        for seq, state, start, end in pieces:
            if end <= seq.prompt_len:
                self.prompt_positions += end - start
                self._note_chunk(seq, state, start, end)
            else:
                for position in range(start, end):
                    tokens.append(seq.token(position)), positions.append(position), tables.append(seq.blocks)
        if tokens:
            self._forget(positions, tables)
            self.rows.run(tokens, positions, tables)

    def _prefill_first_chunk(self, seq: Sequence, end: int) -> None:
        """Positions [0, end) into the sequence's blocks of the drafter's pool, as the target's
        first chunk goes into its pool (the last row's logits, one row of the head, go unused)."""
        self.first_chunks.run(seq.prompt_ids[:end], seq.blocks)

    def _note_chunk(self, seq: Sequence, state: DraftState, start: int, end: int) -> None:
        """The blocks of a whole prompt chunk now hold it; any other write makes them hold nothing."""
        per_chunk, k = self.chunk // self.cache.block_size, start // self.chunk
        blocks = seq.blocks[start // self.cache.block_size : -(-end // self.cache.block_size)]
        whole = start % self.chunk == 0 and end - start == self.chunk and k < len(state.hashes or ())
        for i, block in enumerate(blocks):
            if whole:
                self.held[block] = (state.hashes[k], i)
            else:
                self.held.pop(block, None)
        assert not whole or len(blocks) == per_chunk

    def _forget(self, positions: list[int], tables: list[list[int]]) -> None:
        for position, table in zip(positions, tables):
            self.held.pop(table[position // self.cache.block_size], None)

    @torch.inference_mode()
    def propose(self, entries: list[tuple[Sequence, DraftState, int]]) -> list[list[int]]:
        """entries: (a decoding sequence, its state, width >= 1) -> its `width` draft tokens.

        Every sequence's drafter rows before its last token are in the pool but for at most
        MAX_TAIL_ROWS (fed in pass 0); blocks exist up to its last token plus `width`."""
        widths = [width for _, _, width in entries]
        drafts: list[list[int]] = [[] for _ in entries]
        probs: list[list[torch.Tensor]] = [[] for _ in entries]
        tokens, positions, tables, read = [], [], [], []
        for seq, state, _ in entries:   # pass 0: the unseen tail, then the last token
            assert self.ready(seq, state), "a drafter that lags is caught up before the plan"
            for position in range(state.computed, seq.computed + 1):
                tokens.append(seq.token(position)), positions.append(position), tables.append(seq.blocks)
            read.append(len(tokens) - 1)
        active = list(range(len(entries)))
        for lane in range(max(widths)):
            started = time.perf_counter()
            self._forget(positions, tables)
            logits = self.rows.run(tokens, positions, tables)[read]          # [len(active), V]
            self._choose(entries, active, logits, drafts, probs)
            self._time_pass(time.perf_counter() - started)
            active = [e for e in active if widths[e] > lane + 1]   # the last draft is never fed
            tokens = [drafts[e][-1] for e in active]
            positions = [entries[e][0].computed + lane + 1 for e in active]
            tables = [entries[e][0].blocks for e in active]
            read = list(range(len(active)))
        for (seq, state, width), p in zip(entries, probs):
            state.last_position, state.width = seq.computed, width
            state.probs = torch.stack(p) if p else None
        return drafts

    @staticmethod
    def _choose(entries, active: list[int], logits: torch.Tensor, drafts, probs) -> None:
        """Each active sequence's next draft from its row of `logits`: the argmax (greedy), or a
        draw from its sampler's distribution, kept for rejection sampling."""
        greedy = logits.argmax(-1).tolist()
        for row, e in enumerate(active):
            sampler = entries[e][0].sampler
            if sampler.greedy:
                drafts[e].append(greedy[row])
            else:
                p = sampler.probabilities(logits[row])                      # [V]
                drafts[e].append(sampler.draw(p).item())
                probs[e].append(p)

    def _time_pass(self, seconds: float) -> None:
        self.pass_s = seconds if self.pass_s is None else 0.8 * self.pass_s + 0.2 * seconds

    def drop_graphs(self) -> None:
        self.rows.drop_graphs()
        self.first_chunks.drop_graphs()
