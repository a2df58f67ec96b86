"""What each step computes: a token budget shared by decode rows and whole prefill chunks.

Rules, in order, each step:
1. Cancelled sequences leave and free their blocks.
2. Every decoding sequence gets its next row (its last token, plus drafts when it speculates),
   unless its last allowed token is already computed and only waits to be read back.
   When a new row needs a block and none is free, the most recently admitted sequence is
   preempted: its blocks are freed and it waits at the head of the queue to be recomputed.
3. Replays (generated tokens of a preempted sequence, recomputed as decode rows) and prompt
   chunks share `max_step_tokens`. A chunk is always whole: its boundaries are fixed by the
   sequence (multiples of `chunk` from position 0), never cut by the budget, because a prompt
   row's bits depend on the shape of the chunk it is computed in. A step that has nothing else to
   do takes one chunk even if it is larger than the budget.
4. Waiting sequences are admitted first come, first served, while the pool has blocks for all
   their tokens and the running set has room; leading prompt chunks already in the pool (the same
   prefix, by hash) are shared instead of computed.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from batchd.engine.batch.block_pool import BlockPool, chunk_hashes
from batchd.engine.batch.sequence import Sequence, SequenceStatus


@dataclass
class PromptChunk:
    seq: Sequence
    start: int
    end: int


@dataclass
class StepPlan:
    chunks: list[PromptChunk] = field(default_factory=list)
    decode: list[tuple[Sequence, list[int]]] = field(default_factory=list)   # (sequence, drafts)
    replay: list[tuple[Sequence, int, int]] = field(default_factory=list)    # (sequence, start, end)
    finished: list[Sequence] = field(default_factory=list)                   # cancelled this step

    @property
    def empty(self) -> bool:
        return not (self.chunks or self.decode or self.replay or self.finished)


class Scheduler:
    def __init__(self, blocks: BlockPool, *, chunk: int, max_step_tokens: int, max_running: int,
                 prefix_sharing: bool = True):
        if chunk % blocks.block_size:
            raise ValueError(f"the prefill chunk ({chunk}) must be a multiple of the block size ({blocks.block_size})")
        self.blocks, self.chunk = blocks, chunk
        self.max_step_tokens, self.max_running = max_step_tokens, max_running
        self.prefix_sharing = prefix_sharing
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        needed = self.blocks.blocks_for(seq.prompt_len + seq.request.sampling.max_new_tokens)
        if needed > self.blocks.num_blocks:
            raise ValueError(f"needs {needed} blocks, the pool has {self.blocks.num_blocks}")
        self.waiting.append(seq)

    # ---- the plan --------------------------------------------------------------------------

    def plan(self, drafts_for) -> StepPlan:
        """`drafts_for(seq)` -> the draft tokens a decoding sequence offers this step."""
        plan = StepPlan()
        self._drop_cancelled(plan)
        for seq in list(self.running):
            if seq.status is SequenceStatus.RUNNING and seq.decoding and not seq.out_of_budget:
                drafts = drafts_for(seq)
                if self._grow(seq, seq.computed + 1 + len(drafts)):
                    plan.decode.append((seq, drafts))
        budget = self.max_step_tokens
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if seq.replaying:
                end = min(seq.num_tokens - 1, seq.computed + max(1, budget))
                plan.replay.append((seq, seq.computed, end))
                budget -= end - seq.computed
            elif seq.prefilling:
                budget = self._take_chunk(plan, seq, budget)
        while self.waiting and len(self.running) < self.max_running and (budget > 0 or plan.empty):
            seq = self.waiting[0]
            if not self._admit(seq):
                break
            self.waiting.popleft()
            if seq.prefilling:
                budget = self._take_chunk(plan, seq, budget)
        return plan

    def _take_chunk(self, plan: StepPlan, seq: Sequence, budget: int) -> int:
        end = min(seq.prompt_len, (seq.computed // self.chunk + 1) * self.chunk)
        size = end - seq.computed
        if size <= budget or plan.empty:
            plan.chunks.append(PromptChunk(seq, seq.computed, end))
            return budget - size
        return budget

    def _drop_cancelled(self, plan: StepPlan) -> None:
        for seq in [s for s in self.running if s.cancelled] + [s for s in self.waiting if s.cancelled]:
            self.finish(seq, "cancelled")
            plan.finished.append(seq)

    # ---- memory ----------------------------------------------------------------------------

    def _admit(self, seq: Sequence) -> bool:
        """Give `seq` blocks for every token it holds (its prompt, and after a preemption what it
        generated), sharing leading prompt chunks already in the pool. False if they do not fit."""
        shared: list[int] = []
        hashes = []
        if self.prefix_sharing:
            # at least the prompt's last token is computed, so its logits exist
            hashes = chunk_hashes(seq.prompt_ids, self.chunk, seq.prompt_len - 1)
            per_chunk = self.chunk // self.blocks.block_size
            for h in hashes:
                taken = self.blocks.share_chunk(h, per_chunk)
                if taken is None:
                    break
                shared += taken
        needed = self.blocks.blocks_for(seq.num_tokens) - len(shared)
        if needed > self.blocks.num_free:
            self.blocks.release(shared)
            return False
        seq.blocks = shared + self.blocks.allocate(needed)
        seq.shared_chunks = seq.registered_chunks = len(shared) // max(1, self.chunk // self.blocks.block_size)
        seq.computed = seq.shared_chunks * self.chunk
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return True

    def _grow(self, seq: Sequence, positions: int) -> bool:
        """Blocks for `positions` positions of `seq`, preempting the latest admitted sequences
        while the pool is short. False if `seq` itself had to go."""
        needed = self.blocks.blocks_for(positions) - len(seq.blocks)
        while needed > self.blocks.num_free:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        if needed > 0:
            seq.blocks += self.blocks.allocate(needed)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks; it waits first in line and recomputes its tokens when readmitted."""
        self.running.remove(seq)
        self.blocks.release(seq.blocks)
        seq.blocks, seq.computed = [], 0
        seq.status = SequenceStatus.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def chunk_done(self, seq: Sequence, end: int) -> None:
        """A prompt chunk's rows are in the pool: offer the full chunks to the prefix cache."""
        seq.computed = end
        if not self.prefix_sharing:
            return
        hashes = chunk_hashes(seq.prompt_ids, self.chunk, min(end, seq.prompt_len - 1))
        per_chunk = self.chunk // self.blocks.block_size
        for k in range(seq.registered_chunks, len(hashes)):
            self.blocks.register_chunk(hashes[k], seq.blocks[k * per_chunk : (k + 1) * per_chunk])
        seq.registered_chunks = max(seq.registered_chunks, len(hashes))

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self.blocks.release(seq.blocks)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.blocks = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
