"""Many DeepSeek V4 sequences over one paged pool, planned by engine.batch's Scheduler.

    batch = V4BatchEngine(model, max_context=4096, eos_ids={1})
    seq = batch.submit(prompt_ids, request)
    while batch.has_work:
        for done in batch.step(): ...

The scheduler, its block pool, prefix sharing and preemption (by recompute) are the batch engine's,
unchanged: a V4 block is one unit for every part of the cache (engine.deepseek_v4.paged). Each step
computes every planned piece (prompt chunks, replays, decode and verify rows) as its own forward
over its sequence's blocks: a row's arithmetic depends on its sequence only, so a job's greedy
output is the same alone or batched. That is the correctness layer; packing the pieces of a step
into one pass (and MoE grouped across sequences) is the next (docs/deepseek_v4.md, "What remains").
Speculation: prompt lookup, or (`--spec draft`) the checkpoint's MTP layer (engine.deepseek_v4.mtp,
which keeps its own cache per sequence and reads the target's last-layer streams of every position
the target computes); both verified as extra rows and rolled back by length. A checkpoint without
an MTP layer refuses `--spec draft`.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from batchd.engine.batch.batch_engine import BatchOptions
from batchd.engine.batch.scheduler import Scheduler, StepPlan
from batchd.engine.batch.sequence import Sequence, SequenceStatus
from batchd.engine.capabilities import capabilities_for
from batchd.engine.deepseek_v4.model import DeepseekV4
from batchd.engine.deepseek_v4.mtp import MAX_ADAPTIVE_WIDTH, MTPDrafter, MTPLayer, MTPState, draft_cost
from batchd.engine.deepseek_v4.paged import PagedV4Pool
from batchd.engine.deepseek_v4.rows import ROW_STEP, row_step_groups
from batchd.engine.errors import BadInputError, PromptTooLongError, UnsupportedFeatureError
from batchd.engine.sampling import Sampler
from batchd.engine.speculative.adaptive import MAX_WIDTH, best_width, check_width
from batchd.engine.speculative.proposers import PromptLookupProposer
from batchd.engine.speculative.verify import rejection_sample
from batchd.engine.stopping import StopChecker
from batchd.engine.types import GenerationRequest, Telemetry

MAX_LOOKUP_WIDTH = 8


class V4BatchEngine:
    def __init__(self, model: DeepseekV4, *, max_context: int, eos_ids: set[int], block_size: int = 16,
                 chunk: int = 64, num_blocks: Optional[int] = None, max_step_tokens: Optional[int] = None,
                 max_running: int = 64, prefix_sharing: bool = True,
                 decode_text: Optional[Callable[[list[int]], str]] = None, mtp: Optional[MTPLayer] = None):
        """`num_blocks` None: room for eight sequences of the whole context (on CUDA, at most what
        90% of the free memory holds). Prefix sharing needs
        chunks that hold whole compression windows (a multiple of every rate): else it is off, with a note.
        `mtp`: the checkpoint's MTP layer (engine.deepseek_v4.mtp.build_mtp), the drafter of
        `--spec draft`; None refuses it."""
        if chunk % block_size:
            raise ValueError(f"the prefill chunk ({chunk}) must be a multiple of the block size ({block_size})")
        self.model, self.max_context, self.eos_ids, self.decode_text = model, max_context, eos_ids, decode_text
        self.notes: list[str] = []
        rates = {model.config.compress_rate(i) for i in range(model.config.num_layers)} - {0}
        if prefix_sharing and any(chunk % m for m in rates):
            prefix_sharing = False
            self.notes.append(f"prefix sharing is off: a {chunk}-token chunk splits the compression windows "
                              f"({sorted(rates)} tokens); use a multiple of {max(rates)}")
        blocks_per_context = -(-max_context // block_size)
        # the MTP's caches live outside the pool (one per drafting sequence): leave them room
        mtp_bytes = max_running * mtp.new_cache(max_context + MAX_WIDTH, "meta").nbytes if mtp is not None else 0
        self.pool = PagedV4Pool.sized(model.config, block_size, model.device, model.dtype,
                                      max_blocks=num_blocks or 8 * blocks_per_context,
                                      reserve_bytes=(1 << 30) + mtp_bytes)
        self.scheduler = Scheduler(self.pool.blocks, chunk=chunk, max_step_tokens=max_step_tokens or chunk,
                                   max_running=max_running, prefix_sharing=prefix_sharing)
        # what engine.batch.generate.BatchSession and the worker read of a batch engine
        self.options = BatchOptions(block_size=block_size, max_running=max_running, prefill_chunk=chunk,
                                    prefix_sharing=prefix_sharing)
        self.last_plan: Optional[StepPlan] = None
        self._proposers: dict[int, PromptLookupProposer] = {}
        self.mtp = MTPDrafter(model, mtp) if mtp is not None else None
        self._mtp_states: dict[int, MTPState] = {}
        self._mtp_widths: dict[int, int] = {}   # this plan's MTP draft widths, by seq_id
        self._next_id = 0
        model.setup_rope(max_context)

    @property
    def cache(self) -> PagedV4Pool:
        return self.pool

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def submit(self, prompt_ids: list[int], request: GenerationRequest,
               telemetry: Optional[Telemetry] = None) -> Sequence:
        """Queue one request; BadInputError, UnsupportedFeatureError or PromptTooLongError for it alone."""
        sampling, spec = request.sampling, request.speculation
        if not prompt_ids:
            raise BadInputError("the prompt is empty: give it some text")
        if len(prompt_ids) + sampling.max_new_tokens > self.max_context:
            raise PromptTooLongError(f"the prompt has {len(prompt_ids)} tokens and max_new_tokens is "
                                     f"{sampling.max_new_tokens}: more than the {self.max_context}-token context; "
                                     "shorten the document or lower max_new_tokens")
        if spec.method == "draft" and self.mtp is None:
            raise UnsupportedFeatureError("--spec draft is not supported for this deepseek_v4 checkpoint: "
                                          + capabilities_for("deepseek_v4").reason("--spec draft"))
        check_width(spec.width)
        stopper = StopChecker(self.eos_ids, sampling.max_new_tokens, sampling.stop, decode=self.decode_text,
                              ignore_eos=sampling.ignore_eos)
        seq = Sequence(self._next_id, request, list(prompt_ids), Sampler(sampling, self.model.device), stopper)
        self._next_id += 1
        try:
            self.scheduler.add(seq)
        except ValueError as exc:
            raise PromptTooLongError(f"the request does not fit the KV pool ({exc}); lower max_new_tokens") from None
        if spec.method == "lookup":
            self._proposers[seq.seq_id] = PromptLookupProposer(self.model.device)
            if spec.drafter_path and telemetry is not None:
                telemetry.notes.append("--drafter has no effect with --spec lookup")
        elif spec.method == "draft":
            # room for the prompt, every generated token and the widest chain of draft rows
            self._mtp_states[seq.seq_id] = self.mtp.new_state(len(prompt_ids) + sampling.max_new_tokens + MAX_WIDTH)
            if spec.drafter_path and telemetry is not None:
                telemetry.notes.append("--drafter has no effect for deepseek_v4: it drafts with its own MTP layer")
        return seq

    def cancel(self, seq: Sequence) -> None:
        seq.cancelled = True

    # ---- one step --------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Run one step; return the sequences that finished in it (cancelled ones included)."""
        plan = self.last_plan = self.scheduler.plan(self._drafts_for)
        if self._mtp_widths:
            plan.decode = self._mtp_drafts(plan.decode)
        finished = list(plan.finished)
        began = time.perf_counter()   # the marks engine.batch.generate turns into telemetry
        for seq in [c.seq for c in plan.chunks] + [s for s, *_ in plan.replay] + [s for s, _ in plan.decode]:
            if seq.first_scheduled_at is None:
                seq.first_scheduled_at = began
        for chunk in plan.chunks:
            seq = chunk.seq
            logits, streams = self._forward(seq, seq.prompt_ids[chunk.start : chunk.end], chunk.start, last_only=True)
            self.scheduler.chunk_done(seq, chunk.end)
            if chunk.end == seq.prompt_len:
                seq.prompt_done_at = time.perf_counter()
                if not seq.generated:  # a recompute after preemption already has its tokens
                    self._accept(seq, [int(seq.sampler.sample(logits[-1]))], finished)
            self._observe(seq, chunk.start, streams)
        for seq, start, end in plan.replay:
            # pieces of up to ROW_STEP rows take the row-invariant path, so a replayed position
            # gets the bits its decode or verify row had before the preemption (bf16 too)
            for first in range(start, end, ROW_STEP):
                last = min(end, first + ROW_STEP)
                _, streams = self._forward(seq, [seq.token(p) for p in range(first, last)], first, last_only=True)
                seq.computed = last
                self._observe(seq, first, streams)
        for seq, _ in plan.decode:
            seq.batch_sizes.append(len(plan.decode))
        # a sequence's token and drafts (at most ROW_STEP rows) are never split across forwards
        for group in row_step_groups(plan.decode, lambda entry: 1 + len(entry[1])):
            self._decode(group, finished)
        for seq in finished:
            seq.finished_at = time.perf_counter()
            self._proposers.pop(seq.seq_id, None)
            self._mtp_states.pop(seq.seq_id, None)
        return finished

    def _forward(self, seq: Sequence, tokens: list[int], start: int,
                 last_only: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Positions [start, start + len(tokens)) of `seq` over its blocks -> (logits [T, V] float32
        ([1, V] with last_only), and for a sequence drafting with the MTP layer the target's
        last-layer streams [T, n, H], else None)."""
        view = self.pool.view(seq.blocks, start)
        ids = torch.tensor([tokens], dtype=torch.long, device=self.model.device)
        if seq.seq_id not in self._mtp_states:
            return self.model(ids, view, last_only=last_only)[0], None
        streams = self.model.hidden(ids, view)[0]
        return self.model.head(streams[None, -1:] if last_only else streams[None])[0], streams

    def _mtp_state(self, seq: Sequence) -> Optional[MTPState]:
        """`seq`'s MTP state, emptied when the sequence was preempted since (its rows are recomputed)."""
        state = self._mtp_states.get(seq.seq_id)
        if state is not None and state.preemptions != seq.preemptions:
            state.reset()
            state.preemptions = seq.preemptions
        return state

    def _observe(self, seq: Sequence, start: int, streams: Optional[torch.Tensor]) -> None:
        """Hand the target's streams of positions [start, ...) of `seq` to its MTP (once the tokens
        they were computed for are the sequence's: after acceptance)."""
        self._observe_many([(seq, start, streams)])

    def _observe_many(self, items: list[tuple[Sequence, int, Optional[torch.Tensor]]]) -> None:
        """`_observe` for several sequences, whose MTP catch-ups share forwards."""
        observed = []
        for seq, start, streams in items:
            state = self._mtp_state(seq)
            if state is not None and streams is not None and seq.status is not SequenceStatus.FINISHED:
                observed.append((state, start, streams, seq.tokens()))
        if observed:
            self.mtp.observe_many(observed)

    def _decode(self, group: list[tuple[Sequence, list[int]]], finished: list[Sequence]) -> None:
        """Each sequence's last token and drafts as rows of one forward (DeepseekV4.hidden_rows:
        dense parts and the MoE over every row, attention on each sequence's own view; up to
        ROW_STEP rows, so each row's bits are its sequence's own step's)."""
        rows = [[seq.generated[-1], *drafts] for seq, drafts in group]
        views = [self.pool.view(seq.blocks, seq.computed) for seq, _ in group]
        streams = self.model.hidden_rows(rows, views)[0]                                  # [N, n, H]
        logits = self.model.head(streams[None])[0]                                        # [N, V]
        greedy = logits.argmax(-1).tolist()
        first, accepted_rows = 0, []
        for (seq, drafts), lanes in zip(group, rows):
            end, start = first + len(lanes), seq.computed
            accepted = self._verify(seq, drafts, logits[first:end], greedy[first:end], finished)
            if seq.seq_id in self._mtp_states:   # the rejected rows' streams are dropped
                accepted_rows.append((seq, start, streams[first : first + 1 + accepted]))
            first = end
        self._observe_many(accepted_rows)   # the group's MTP catch-ups share forwards

    def _verify(self, seq: Sequence, drafts: list[int], lanes: torch.Tensor, greedy: list[int],
                finished: list[Sequence]) -> int:
        """lanes [1 + q, V]: accept the longest verified prefix (greedy) or rejection-sample
        (arXiv 2211.17192); -> the drafts accepted. Rejected rows are forgotten by `computed` alone."""
        if seq.sampler.greedy:
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == greedy[accepted]:
                accepted += 1
            new = greedy[: accepted + 1]
        elif drafts:
            state = self._mtp_states.get(seq.seq_id)
            draft_probs = state.probs if state is not None else None     # None: one-hot (lookup)
            verdict = rejection_sample(seq.sampler.probabilities(lanes), torch.tensor(drafts, device=lanes.device),
                                       draft_probs, seq.sampler)
            accepted, new = verdict.accepted, verdict.tokens
        else:
            accepted, new = 0, [int(seq.sampler.sample(lanes[0]))]
        if drafts:
            seq.record_speculation(len(drafts), accepted)
        seq.computed += 1 + accepted
        self._accept(seq, new, finished)
        return accepted

    def _drafts_for(self, seq: Sequence) -> list[int]:
        proposer, state = self._proposers.get(seq.seq_id), self._mtp_state(seq)
        if proposer is None and state is None:
            return []
        room = seq.request.sampling.max_new_tokens - len(seq.generated) - 1
        fixed = seq.request.speculation.width
        if proposer is not None:
            width = min(fixed if fixed is not None else min(best_width(seq.spec_alpha, 0.05), MAX_LOOKUP_WIDTH), room)
            return proposer.propose(seq.tokens(), width).tokens.tolist() if width >= 1 else []
        adaptive = min(best_width(seq.spec_alpha, draft_cost(self.model.config)), MAX_ADAPTIVE_WIDTH)
        width = max(0, min(fixed if fixed is not None else adaptive, room))
        self._mtp_widths[seq.seq_id] = width
        return [DRAFT_PLACEHOLDER] * width   # the plan reserves their positions; _mtp_drafts fills them

    def _mtp_drafts(self, decode: list[tuple[Sequence, list[int]]]) -> list[tuple[Sequence, list[int]]]:
        """The planned decode rows with the MTP's drafts in place of the placeholders: every
        scheduled sequence's drafts at once (MTPDrafter.propose_many), and only theirs, so a
        sequence the plan preempted draws nothing from its sampler."""
        widths, self._mtp_widths = self._mtp_widths, {}
        drafting = [seq for seq, _ in decode if seq.seq_id in widths]
        proposals = self.mtp.propose_many([(self._mtp_states[seq.seq_id], seq.tokens(), widths[seq.seq_id], seq.sampler)
                                           for seq in drafting])
        by_id = {seq.seq_id: drafts for seq, drafts in zip(drafting, proposals)}
        return [(seq, by_id.get(seq.seq_id, drafts)) for seq, drafts in decode]

    def _accept(self, seq: Sequence, new_tokens: list[int], finished: list[Sequence]) -> None:
        reason = seq.stopper.accept(seq.generated, new_tokens)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            finished.append(seq)


DRAFT_PLACEHOLDER = -1   # a draft the plan counts before the MTP has made it
