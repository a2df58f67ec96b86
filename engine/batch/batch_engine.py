"""The batch engine: many sequences per step over one paged KV pool (docs/engine.md, "Batching").

    batch = BatchEngine(model, scratch, eos_ids=..., options=BatchOptions())
    seq = batch.submit(prompt_ids, request)
    while batch.has_work:
        for done in batch.step(): ...

Token ids only; text, stop-string cuts and hashing are the caller's (engine.runtime). Each step:
the scheduler's plan (engine.batch.scheduler); prompt chunks (a prompt's first through the
one-sequence prefill, the continuing ones together over the paged pool: engine.batch.chunks); all
decode, verify and replay rows in one pass (engine.batch.rows); one read-back of the chosen tokens.
Sequences that speculate with a draft model get their drafts from its own paged pool first
(engine.batch.drafting), verified as rows of the same pass.

Launching ahead. A step of decode rows only (no prompt chunks, replays or drafts: most steps of
an overnight batch) is launched before the previous step's tokens are read
back: each row whose input is still on the device takes it there (RowRunner.run's `carried`), and
the host reads the previous step's tokens while the GPU computes this one, so the GPU never waits
for the host's stop checks, planning and input building. Each sequence holds a placeholder for
its token in flight (Sequence.pending), so the plan's positions and blocks are exact; a sequence
learns that it stopped one step late, and the row it ran in that step is dropped (it wrote only
into its own blocks, freed after it in stream order). A step of any other kind reads back the one
in flight first. The tokens are the same either way: a row's logits and argmax do not depend on
the step it runs in.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from batchd.engine.batch.chunks import ChunkBatch, ChunkPacking, forward_chunks
from batchd.engine.batch.drafting import DraftState, PooledDrafter
from batchd.engine.batch.first_chunks import FirstChunkRunner
from batchd.engine.batch.graphs import RowRunner
from batchd.engine.batch.paged_cache import PagedKVCache, bytes_per_block
from batchd.engine.batch.scheduler import PromptChunk, Scheduler, StepPlan
from batchd.engine.batch.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from batchd.engine.errors import BadInputError, PromptTooLongError, UnsupportedFeatureError
from batchd.engine.generate import synchronize
from batchd.engine.linear import CPU_INVARIANT_ROWS
from batchd.engine.sampling import Sampler
from batchd.engine.speculative.adaptive import best_width, check_width
from batchd.engine.speculative.proposers import PromptLookupProposer
from batchd.engine.speculative.verify import rejection_sample
from batchd.engine.stopping import StopChecker
from batchd.engine.types import GenerationRequest, Telemetry

MAX_DRAFTS = 16
PENDING_DRAFT = -1   # a draft row reserved in the plan, whose token the drafter proposes after it


def step_reserve_bytes(config, chunk: int) -> int:
    """Device memory a step's activations take beside the pools: a chunk's logits row, its MLP
    and attention tensors, with headroom."""
    return 4 * chunk * (config.intermediate_size * 2 + config.hidden_size * 4) * 4 + (1 << 30)


def drafter_size_ratio(drafter_model, target_model) -> float:
    """A drafter row pass's cost relative to a target step, before either is measured: the ratio
    of their weights."""
    def weights(model) -> int:
        return sum(p.numel() for p in model.parameters())
    return weights(drafter_model) / weights(target_model)


@dataclass(frozen=True)
class BatchOptions:
    """block_size: positions per KV block; max_step_tokens: prompt and replay tokens per step
    (None: four chunks on CUDA, one on the CPU); max_running: sequences in flight; slab_rows: the
    fixed row count of every CUDA projection of decode rows (batch_invariant=False: one GEMM of
    however many rows the step has, which is faster and batch-dependent); kv_memory_fraction: the share of free
    device memory the pool takes; max_blocks: a cap on the pool (the CPU's size: None gives room
    for eight sequences of the whole context); prefix_sharing: share identical prompt chunks;
    drafters: `drafter_path`s whose paged pools are sized with the target's (each has the target's
    block count, so the memory fraction is shared among them); other drafters get a pool when a
    job first asks for them, if the device has room for it then."""

    block_size: int = 16
    max_step_tokens: Optional[int] = None
    max_running: int = 256
    slab_rows: int = 128
    kv_memory_fraction: float = 0.9
    max_blocks: Optional[int] = None
    prefix_sharing: bool = True
    max_lookup_width: int = 8
    prefill_chunk: Optional[int] = None   # prompt tokens a chunk (a multiple of block_size); None: the engine's
    batch_invariant: bool = True   # False: one GEMM over every decode row (benchmarks measure the difference)
    cuda_graphs: bool = True
    drafters: tuple[str, ...] = ()
    # prompt-chunk projections in fixed slabs of this many rows, short first chunks packed with the
    # rest (engine.batch.chunks.ChunkPacking); None: 1,024 on CUDA, one GEMM per chunk on the CPU; 0: off
    chunk_slab_rows: Optional[int] = None
    launch_ahead: bool = True   # decode steps launched before the last one is read back (above)


@dataclass
class InFlightStep:
    """A decode step launched ahead, its tokens not read back yet."""

    rows: dict[int, tuple[Sequence, int]]   # seq_id -> (the sequence, its row in `ids`)
    ids: torch.Tensor                        # [N] long on the device: each row's greedy token
    host: torch.Tensor                       # [N] long on the host: ids' copy, complete once `ready` is
    ready: Optional[torch.cuda.Event]        # None on the CPU (the copy is done when it returns)


class BatchEngine:
    def __init__(self, model, scratch, *, max_context: int, prefill_chunk: int, eos_ids: set[int],
                 decode_text: Optional[Callable[[list[int]], str]] = None, options: BatchOptions = BatchOptions(),
                 drafters=None):
        """`drafters`: the target engine's registry (engine.speculative.Drafters), where jobs
        that speculate with a draft model find it by `drafter_path` (None: such jobs are refused)."""
        self.model, self.scratch, self.options = model, scratch, options
        self.drafters = drafters
        self.device = model.device
        self.max_context, self.eos_ids, self.decode_text = max_context, eos_ids, decode_text
        chunk = options.prefill_chunk or prefill_chunk
        chunk = max(options.block_size, chunk // options.block_size * options.block_size)
        max_blocks = options.max_blocks
        if max_blocks is None and self.device.type != "cuda":
            max_blocks = 8 * -(-max_context // options.block_size)
        config = model.config
        declared = [(path, self._load_drafter(path, None)) for path in options.drafters]
        reserve = step_reserve_bytes(config, chunk) + sum(step_reserve_bytes(d.config, chunk) for _, d in declared)
        self.cache = PagedKVCache.sized(config, self.device, scratch.dtype, block_size=options.block_size,
                                        memory_fraction=options.kv_memory_fraction, reserve_bytes=reserve,
                                        max_blocks=max_blocks, extra_bytes_per_block=sum(
                                            bytes_per_block(d.config, options.block_size, scratch.dtype)
                                            for _, d in declared))
        step_tokens = options.max_step_tokens or (4 * chunk if self.device.type == "cuda" else chunk)
        self.scheduler = Scheduler(self.cache.blocks, chunk=chunk, max_step_tokens=step_tokens,
                                   max_running=options.max_running, prefix_sharing=options.prefix_sharing)
        self.chunk = chunk
        slab = options.slab_rows if options.batch_invariant else None
        self.rows = RowRunner(model, self.cache, max_context=max_context, slab_rows=slab, cuda_graphs=options.cuda_graphs)
        self.first_chunks = FirstChunkRunner(model, scratch, self.cache, cuda_graphs=options.cuda_graphs)
        self.packing = ChunkPacking.for_device(self.device, options.chunk_slab_rows)
        self._next_id = 0
        self._proposers: dict[int, PromptLookupProposer] = {}
        # draft-model speculation: a pool per drafter (by drafter_path), a state per sequence
        self._pooled: dict[str, PooledDrafter] = {}
        self._draft_states: dict[int, DraftState] = {}
        self._drafting_s = 0.0   # drafter seconds of the current step (not the target's step time)
        self._plain_step_s: Optional[float] = None
        for path, drafter in declared:
            self._pooled[path] = self._pool_for(path, drafter)
        self.steps = 0
        self.notes: list[str] = []   # feature-gate notes every result of this engine carries
        # speculation's budget: seconds of decode-only steps per row bucket (moving averages), and
        # the draft rows this step may still take
        self._bucket_seconds: dict[int, float] = {}
        self._draft_rows = 0
        self._draft_share = 0   # the most draft rows one sequence takes this step
        self.last_plan: Optional[StepPlan] = None
        self.in_flight: Optional[InFlightStep] = None
        self.steps_ahead = 0   # steps launched ahead (tests check the path ran)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ---- requests --------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], request: GenerationRequest, telemetry: Optional[Telemetry] = None) -> Sequence:
        """Queue one request. Raises BadInputError (bad params, empty prompt, a drafter that
        cannot draft for this target), UnsupportedFeatureError (no room for a drafter's pool) or
        PromptTooLongError, for this request only. `telemetry` gets the drafter's load time."""
        sampling, spec = request.sampling, request.speculation
        if not prompt_ids:
            raise BadInputError("the prompt is empty: give it some text")
        sampler = Sampler(sampling, self.device)
        if len(prompt_ids) + sampling.max_new_tokens > self.max_context:
            raise PromptTooLongError(
                f"the prompt has {len(prompt_ids)} tokens and max_new_tokens is {sampling.max_new_tokens}: "
                f"{len(prompt_ids) + sampling.max_new_tokens} > the {self.max_context}-token context; shorten the "
                "document, lower max_new_tokens or submit with --compress auto")
        check_width(spec.width)
        drafter = self._drafter_for(spec.drafter_path, telemetry) if spec.method == "draft" else None
        if spec.method == "lookup" and spec.drafter_path and telemetry is not None:
            telemetry.notes.append("--drafter has no effect with --spec lookup")
        stopper = StopChecker(self.eos_ids, sampling.max_new_tokens, sampling.stop, decode=self.decode_text,
                              ignore_eos=sampling.ignore_eos)
        seq = Sequence(self._next_id, request, list(prompt_ids), sampler, stopper)
        self._next_id += 1
        try:
            self.scheduler.add(seq)
        except ValueError as exc:
            raise PromptTooLongError(f"the request does not fit the KV pool ({exc}); lower max_new_tokens "
                                     "or raise kv_memory_fraction") from None
        if spec.method == "lookup":
            self._proposers[seq.seq_id] = PromptLookupProposer(self.device)
        elif drafter is not None:
            self._draft_states[seq.seq_id] = DraftState(drafter)
        return seq

    def _drafter_for(self, drafter_path: Optional[str], telemetry: Optional[Telemetry]) -> PooledDrafter:
        """The pooled drafter of `drafter_path`, loaded and given its pool on first use."""
        if not drafter_path:
            raise BadInputError("--spec draft needs --drafter PATH (a small model with the target's tokenizer)")
        pooled = self._pooled.get(drafter_path)
        if pooled is None:
            pooled = self._pooled[drafter_path] = self._pool_for(drafter_path, self._load_drafter(drafter_path, telemetry))
        return pooled

    def _load_drafter(self, drafter_path: str, telemetry: Optional[Telemetry]):
        if self.drafters is None:
            raise UnsupportedFeatureError("this batch engine was built without the target's drafters; build it "
                                          "through Engine.batch_engine, or use --spec lookup")
        return self.drafters.get(drafter_path, telemetry)

    def _pool_for(self, drafter_path: str, drafter) -> PooledDrafter:
        """A pool with the target's block count for `drafter`: the block tables serve both."""
        blocks, dtype = self.cache.blocks, self.cache.dtype
        if self.device.type == "cuda":
            need = bytes_per_block(drafter.config, blocks.block_size, dtype) * (blocks.num_blocks + 1)
            free, _ = torch.cuda.mem_get_info(self.device)
            if need + step_reserve_bytes(drafter.config, self.chunk) > free:
                raise UnsupportedFeatureError(
                    f"drafter {drafter_path}'s KV pool needs {need / 2**30:.1f} GiB for the target's "
                    f"{blocks.num_blocks} blocks and {free / 2**30:.1f} GiB are free: name it in "
                    "BatchOptions.drafters so the pools are sized together, or use --spec lookup")
        return PooledDrafter(drafter_path, drafter, num_blocks=blocks.num_blocks, block_size=blocks.block_size,
                             dtype=dtype, max_context=self.max_context, chunk=self.chunk,
                             slab_rows=self.rows.slab_rows, cuda_graphs=self.rows.cuda_graphs, packing=self.packing)

    def has_drafter(self, drafter_path: str) -> bool:
        """Whether `drafter_path` has its pool here already."""
        return drafter_path in self._pooled

    def drop_graphs(self) -> None:
        """Forget every captured row graph, the drafters' too (parking moved the weights they read)."""
        self.rows.drop_graphs()
        self.first_chunks.drop_graphs()
        for pooled in self._pooled.values():
            pooled.drop_graphs()

    def cancel(self, seq: Sequence) -> None:
        """`seq` leaves at the next step and its blocks are freed."""
        seq.cancelled = True

    # ---- one step --------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Run one step; return the sequences that finished in it (cancelled ones included). A
        step launched ahead reports its sequences at the next step (docstring, "Launching ahead")."""
        self._draft_rows = self._draft_row_budget()
        began = time.perf_counter()
        self._drafting_s = 0.0
        self._catch_up_drafters()
        plan = self.last_plan = self.scheduler.plan(self._drafts_for)
        finished = list(plan.finished)
        now = time.perf_counter()
        for seq in [c.seq for c in plan.chunks] + [s for s, *_ in plan.replay] + [s for s, _ in plan.decode]:
            if seq.first_scheduled_at is None:
                seq.first_scheduled_at = now
        if self._can_launch_ahead(plan):
            launched = self._launch_decode(plan)
            self._read_back(finished)   # the step before, while this one runs
            self.in_flight = launched
            self.steps_ahead += 1
        else:
            settled = time.perf_counter()
            if self._read_back(finished):
                drop_finished(plan)
            began += time.perf_counter() - settled   # the bucket timing below is this step's alone
            if plan.chunks:
                self._prefill_chunks(plan.chunks, finished)
            if plan.decode or plan.replay:
                self._propose_drafts(plan)
                self._run_rows(plan, finished)
                if not plan.chunks and not plan.replay:   # the rows' read-back synchronised the step
                    self._time_bucket(sum(1 + len(d) for _, d in plan.decode),
                                      time.perf_counter() - began - self._drafting_s)
        self.steps += 1
        for seq in finished:
            seq.finished_at = time.perf_counter()
            self._proposers.pop(seq.seq_id, None)
            self._draft_states.pop(seq.seq_id, None)
        return finished

    # ---- launching ahead -------------------------------------------------------------------

    def _can_launch_ahead(self, plan: StepPlan) -> bool:
        """Only decode rows without drafts, of sequences that need no token on the host next
        step (prompt lookup and drafters read the tokens)."""
        return (self.options.launch_ahead and bool(plan.decode) and not plan.chunks and not plan.replay
                and all(not drafts and seq.seq_id not in self._proposers and seq.seq_id not in self._draft_states
                        for seq, drafts in plan.decode))

    def _launch_decode(self, plan: StepPlan) -> InFlightStep:
        """Queue the plan's decode rows and their tokens (the argmax, or a sampled row's draw from
        its own seeded generator, as the stepwise path draws it); a row whose input token is
        pending takes it from the step in flight, on the device."""
        previous = self.in_flight
        tokens, positions, tables, sources = [], [], [], []
        for seq, _ in plan.decode:
            if seq.pending:   # its input is the token of the step in flight
                tokens.append(0), sources.append(previous.rows[seq.seq_id][1])
            else:
                tokens.append(seq.generated[-1]), sources.append(-1)
            positions.append(seq.computed), tables.append(seq.blocks)
        carried = (previous.ids, sources) if previous is not None and max(sources) >= 0 else None
        logits = self.rows.run(tokens, positions, tables, carried)   # [N, V]
        ids = logits.argmax(-1)                                       # [N] on the device
        rows = {}
        for i, (seq, _) in enumerate(plan.decode):
            if not seq.sampler.greedy:
                ids[i] = seq.sampler.sample(logits[i])
            rows[seq.seq_id] = (seq, i)
            seq.generated.append(PENDING_TOKEN)
            seq.pending += 1
            seq.computed += 1
            seq.batch_sizes.append(len(plan.decode))
        if ids.is_cuda:
            host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            host.copy_(ids, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host, ready = ids, None
        return InFlightStep(rows, ids, host, ready)

    def _read_back(self, finished: list[Sequence]) -> bool:
        """Read the step in flight's tokens and accept them (stop checks); False if none was."""
        step, self.in_flight = self.in_flight, None
        if step is None:
            return False
        if step.ready is not None:
            step.ready.synchronize()
        ids = step.host.tolist()
        for seq, row in step.rows.values():
            later = seq.pending - 1   # placeholders of a step launched after this one
            del seq.generated[len(seq.generated) - seq.pending:]
            seq.pending = 0
            if seq.status is SequenceStatus.FINISHED:   # cancelled, or stopped a step before: row dropped
                continue
            self._accept(seq, [ids[row]], finished)
            if seq.status is not SequenceStatus.FINISHED and later:
                seq.generated += [PENDING_TOKEN] * later
                seq.pending = later
        return True

    def _prefill_chunks(self, chunks: list[PromptChunk], finished: list[Sequence]) -> None:
        """The step's prompt chunks. Chunks that continue a prompt, and on CUDA short first chunks,
        run together in one pass over the pool (engine.batch.chunks, kernels.paged_prefill); a
        long first chunk runs the engine's own prefill (its fused kernels and flash attention over
        a contiguous scratch cache, measured faster than any paged pass at 4K rows) and is copied
        into the pool. The path follows from the chunk alone (`ChunkPacking.in_pass`), so a row's
        bits never depend on the rest of the step."""
        logits: dict[int, torch.Tensor] = {}
        packed = [c for c in chunks if self.packing.in_pass(c.start, c.end)]
        for chunk in chunks:
            if not self.packing.in_pass(chunk.start, chunk.end):
                logits[id(chunk)] = self._prefill_first_chunk(chunk)
        if packed:
            batch = ChunkBatch.build([(c.seq.prompt_ids[c.start : c.end], c.start, c.seq.blocks) for c in packed],
                                     self.cache.block_size, self.cache.pad_block, self.device)
            rows = forward_chunks(self.model, self.cache, batch, slab_rows=self.rows.slab_rows,
                                  max_context=self.max_context, chunk_slab_rows=self.packing.slab_rows)   # [C, V]
            logits.update({id(c): rows[i] for i, c in enumerate(packed)})
        # each prompt's first token: every draw queued, then one read-back for all of them
        last = [c for c in chunks if c.end == c.seq.prompt_len and not c.seq.generated]   # not a recompute
        firsts = torch.stack([c.seq.sampler.sample(logits[id(c)]) for c in last]).tolist() if last else []
        first_of = {id(c): token for c, token in zip(last, firsts)}
        for chunk in chunks:
            seq = chunk.seq
            self.scheduler.chunk_done(seq, chunk.end)
            if id(chunk) in first_of:
                self._accept(seq, [first_of[id(chunk)]], finished)
            if chunk.end == seq.prompt_len:
                # after the first tokens' read-back: the prompt's rows are computed by then
                seq.prompt_done_at = time.perf_counter()

    def _prefill_first_chunk(self, chunk: PromptChunk) -> torch.Tensor:
        """Positions [0, end) through the one-sequence prefill on the scratch cache, then into the
        sequence's blocks (engine.batch.first_chunks); the last row's logits [V] float32."""
        return self.first_chunks.run(chunk.seq.prompt_ids[:chunk.end], chunk.seq.blocks)

    # ---- speculation in the batch ------------------------------------------------------------
    #
    # A verify lane is one more row of the step. Rows are computed in buckets (CUDA: slabs of
    # `slab_rows`; the CPU: groups of 17), so lanes that fill the plain decode rows' last bucket
    # cost little, and a lane that opens a new bucket costs what the measured step times of the
    # two buckets say. Drafts are offered only within the rows that pay: at a large batch, where
    # the decode rows fill their buckets and a bigger bucket measured slower than the tokens its
    # lanes are expected to add, speculation turns itself off. The rows that pay are shared evenly
    # among the speculating sequences, and each one's width follows its own acceptance
    # (engine.speculative.adaptive.best_width). With a draft model, each draft also costs a row
    # pass of the drafter, measured against the target's plain step at the current batch size:
    # where no width gains over plain decoding, that sequence does not speculate.

    def _row_step(self) -> int:
        """Rows a step's cost moves by: the graphs' bucket on CUDA, the invariant group on the CPU."""
        return self.rows.bucket(1) if self.device.type == "cuda" else CPU_INVARIANT_ROWS

    def _draft_row_budget(self) -> int:
        running = [s for s in self.scheduler.running if s.decoding]
        speculating = [s for s in running if s.seq_id in self._proposers or s.seq_id in self._draft_states]
        if not speculating:
            return 0
        budget = self._free_draft_rows(running, speculating)
        # an even share each: a sequence early in the running list must not take every row
        self._draft_share = max(1, budget // len(speculating))
        return budget

    def _free_draft_rows(self, running: list[Sequence], speculating: list[Sequence]) -> int:
        plain, step = len(running), self._row_step()
        bucket = -(-plain // step) * step
        budget = bucket - plain
        t_now, t_next = self._bucket_seconds.get(bucket), self._bucket_seconds.get(bucket + step)
        self._plain_step_s = t_now
        alpha = sum(s.spec_alpha for s in speculating) / len(speculating)
        if t_next is None or t_now is None:
            # not measured yet: try the next bucket once, so that its cost gets measured
            return budget + (step if t_now is not None and t_next is None else 0)
        # a full extra bucket of lanes adds about `step * alpha` tokens to `plain` a step
        if t_next / t_now < 1 + step * alpha / plain:
            budget += step
        return budget

    def _time_bucket(self, rows: int, seconds: float) -> None:
        step = self._row_step()
        bucket = -(-rows // step) * step
        old = self._bucket_seconds.get(bucket)
        self._bucket_seconds[bucket] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def _drafts_for(self, seq: Sequence) -> list[int]:
        """The drafts `seq` offers this step. A sequence with a draft model gets placeholders,
        which reserve its rows and blocks in the plan; its drafter fills them after the plan
        (`_propose_drafts`), once every draft row has a block."""
        proposer, state = self._proposers.get(seq.seq_id), self._draft_states.get(seq.seq_id)
        if (proposer is None and state is None) or self._draft_rows <= 0:
            return []
        room = seq.request.sampling.max_new_tokens - len(seq.generated) - 1
        fixed = seq.request.speculation.width
        if state is not None:
            if not state.drafter.ready(seq, state):   # its drafter is still catching up
                return []
            width = fixed if fixed is not None else self._drafter_width(seq, state.drafter)
        else:
            width = fixed if fixed is not None else best_width(seq.spec_alpha, 0.05)
        width = min(width, room, self._draft_rows, self._draft_share, MAX_DRAFTS,
                    self.options.max_lookup_width if fixed is None else MAX_DRAFTS)
        if width < 1:
            return []
        drafts = [PENDING_DRAFT] * width if state is not None else proposer.propose(seq.tokens(), width).tokens.tolist()
        self._draft_rows -= len(drafts)
        return drafts

    def _drafter_width(self, seq: Sequence, drafter: PooledDrafter) -> int:
        """Adaptive width with a draft model: each draft costs a drafter row pass, measured
        against the target's plain step at this batch size; 0 where no width yields more tokens
        per unit of time than plain decoding (speculation off for this step)."""
        if drafter.pass_s is None or self._plain_step_s is None:
            cost = 0.05 + drafter_size_ratio(drafter.model, self.model)   # a prior until both are measured
        else:
            cost = 0.05 + drafter.pass_s / self._plain_step_s
        width = best_width(seq.spec_alpha, cost)
        gain = sum(seq.spec_alpha**i for i in range(width + 1)) / (1 + cost * width)
        return width if gain > 1 else 0

    def _catch_up_drafters(self) -> None:
        """Bring each lagging drafter to what the target computed (prompt chunks, replays after a
        preemption), up to `max_step_tokens` positions a step (at least one chunk), decoding
        sequences first: they speculate as soon as their drafter is there."""
        if not self._draft_states:
            return
        started = time.perf_counter()
        waiting: dict[PooledDrafter, list[tuple[Sequence, DraftState, int, int]]] = {}
        budget = self.scheduler.max_step_tokens
        running = sorted(self.scheduler.running, key=lambda s: not s.decoding)
        for seq in running:
            state = self._draft_states.get(seq.seq_id)
            if state is None or seq.cancelled:
                continue
            state.sync(seq)
            for start, end in state.drafter.pieces(seq, state):
                if end - start > budget and waiting:
                    break
                waiting.setdefault(state.drafter, []).append((seq, state, start, end))
                budget -= end - start
                state.computed = end
        for drafter, pieces in waiting.items():
            drafter.catch_up(pieces)
        if waiting:
            synchronize(self.device)
            self._drafting_s += time.perf_counter() - started

    def _propose_drafts(self, plan: StepPlan) -> None:
        """Replace each draft-model sequence's placeholders in `plan.decode` with its drafter's
        proposal: the drafters run their row passes, one batch per drafter."""
        groups: dict[PooledDrafter, list[tuple[int, Sequence, DraftState, int]]] = {}
        for i, (seq, drafts) in enumerate(plan.decode):
            state = self._draft_states.get(seq.seq_id)
            if state is not None and drafts:
                groups.setdefault(state.drafter, []).append((i, seq, state, len(drafts)))
        started = time.perf_counter()
        for drafter, entries in groups.items():
            proposals = drafter.propose([(seq, state, width) for _, seq, state, width in entries])
            for (i, seq, _, _), drafts in zip(entries, proposals):
                plan.decode[i] = (seq, drafts)
        self._drafting_s += time.perf_counter() - started

    def _run_rows(self, plan: StepPlan, finished: list[Sequence]) -> None:
        tokens, positions, tables = [], [], []
        for seq, start, end in plan.replay:
            for p in range(start, end):
                tokens.append(seq.token(p)), positions.append(p), tables.append(seq.blocks)
        decode_rows: list[tuple[Sequence, list[int], int]] = []   # (sequence, drafts, its first row)
        for seq, drafts in plan.decode:
            decode_rows.append((seq, drafts, len(tokens)))
            for i, token in enumerate([seq.generated[-1], *drafts]):
                tokens.append(token), positions.append(seq.computed + i), tables.append(seq.blocks)
        logits = self.rows.run(tokens, positions, tables)   # [N, V]
        for seq, start, end in plan.replay:
            seq.computed = end
        greedy_ids = logits.argmax(-1).tolist() if decode_rows else []
        batch_size = len(plan.decode)
        for seq, drafts, at in decode_rows:
            seq.batch_sizes.append(batch_size)
            lanes = logits[at : at + len(drafts) + 1]
            if seq.sampler.greedy:
                target = greedy_ids[at : at + len(drafts) + 1]
                accepted = 0
                while accepted < len(drafts) and drafts[accepted] == target[accepted]:
                    accepted += 1
                new = target[: accepted + 1]
            elif drafts:
                state = self._draft_states.get(seq.seq_id)   # a draft model's distributions; lookup's are one-hot
                verdict = rejection_sample(seq.sampler.probabilities(lanes), torch.tensor(drafts, device=self.device),
                                           state.probs if state is not None else None, seq.sampler)
                accepted, new = verdict.accepted, verdict.tokens
            else:
                accepted, new = 0, [seq.sampler.sample(lanes[0]).item()]
            if drafts:
                seq.record_speculation(len(drafts), accepted)
            seq.computed += 1 + accepted
            if drafts and seq.seq_id in self._draft_states:
                self._draft_states[seq.seq_id].verified(seq)
            self._accept(seq, new, finished)

    def _accept(self, seq: Sequence, new_tokens: list[int], finished: list[Sequence]) -> None:
        reason = seq.stopper.accept(seq.generated, new_tokens)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            finished.append(seq)


def drop_finished(plan: StepPlan) -> None:
    """Drop the rows and chunks of sequences that turned out to have finished before this step
    (learnt from the step read back after the plan): their blocks are free again."""
    def live(seq: Sequence) -> bool:
        return seq.status is not SequenceStatus.FINISHED
    plan.chunks = [c for c in plan.chunks if live(c.seq)]
    plan.replay = [r for r in plan.replay if live(r[0])]
    plan.decode = [d for d in plan.decode if live(d[0])]
