"""Requests in, results out as each finishes: the text side of the batch engine.

    session = BatchSession(engine)
    handle = session.add(request)            # raises EngineError for that request alone
    outcomes = session.add_many(requests)    # Handle or that request's exception, each; PFlash
                                             # jobs among them share drafter visits
    while session.has_work:
        for handle, result in session.step(): ...

    for index, outcome in generate_many(engine, requests):   # the same, for a fixed list
        ...   # outcome: a GenerationResult, or the EngineError that failed that request alone

A session takes requests while it runs (a worker's jobs join the batch as they arrive). Each
request is encoded (and compressed by PFlash when it asks) before it joins the batch; a request
that cannot run fails alone. Results carry the same fields as `Engine.generate`'s, plus the
batch's own telemetry: mean batch size while the job ran, seconds waiting for a slot against
seconds running, and preemptions.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Union

from batchd.engine.batch.sequence import Sequence
from batchd.engine.errors import EngineError
from batchd.engine.pflash import ensure_target_resident
from batchd.engine.hashes import sha256_hex, token_ids_sha256
from batchd.engine.whole_chars import output_text
from batchd.engine.types import GenerationRequest, GenerationResult, Telemetry

Outcome = Union[GenerationResult, EngineError]


@dataclass(eq=False)
class Handle:
    """One request in a session: what the caller holds to cancel it or match its result."""

    request: GenerationRequest
    telemetry: Telemetry
    prompt_tokens: int = 0
    added_at: float = field(default_factory=time.perf_counter)
    compress_drafter_sha256: str = ""   # the PFlash drafter's checkpoint hash, when compressed
    seq: Sequence = None

    @property
    def finished(self) -> bool:
        return self.seq.finish_reason is not None


class BatchSession:
    """The engine's batch over a stream of requests; one thread drives it (add, cancel, step)."""

    def __init__(self, engine):
        ensure_target_resident(engine)   # an earlier job's failed unpark is retried before these
        self.engine = engine
        self.batch = engine.batch_engine()
        self.live: dict[int, Handle] = {}   # seq_id -> handle, until it finishes

    @property
    def has_work(self) -> bool:
        return self.batch.has_work

    def __len__(self) -> int:
        return len(self.live)

    def add(self, request: GenerationRequest) -> Handle:
        """Encode, compress and queue one request; raises its EngineError (bad input, too long,
        a drafter that failed) without touching the others."""
        [outcome] = self.add_many([request])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def add_many(self, requests: list[GenerationRequest]) -> list[Union[Handle, Exception]]:
        """Requests that arrived together: each one's Handle, or the exception that stopped it
        alone (an EngineError for bad input, too long, a drafter that failed). The ones that ask
        for PFlash share drafter visits: one load, park and unpark per drafter for all of them."""
        engine = self.engine
        out: list = [None] * len(requests)
        encoded = []   # (index, handle, prompt ids)
        for i, (request, prompt_ids) in enumerate(zip(requests, engine.codec.encode_requests(requests))):
            handle = Handle(request, Telemetry(device=str(engine.device), notes=list(engine.notes) + self.batch.notes))
            if isinstance(prompt_ids, Exception):   # this request's error
                out[i] = prompt_ids
                continue
            handle.prompt_tokens = len(prompt_ids)
            encoded.append((i, handle, prompt_ids))
        compressed = engine.compress_many([(ids, h.request, h.telemetry) for _, h, ids in encoded])
        for (i, handle, _), outcome in zip(encoded, compressed):
            if isinstance(outcome, Exception):
                out[i] = outcome
                continue
            handle.compress_drafter_sha256 = outcome.drafter_sha256
            try:
                handle.seq = self.batch.submit(outcome.ids, handle.request, handle.telemetry)
            except Exception as exc:  # noqa: BLE001 - too long for the pool, bad params: this request's
                out[i] = exc
                continue
            self.live[handle.seq.seq_id] = handle
            out[i] = handle
        return out

    def cancel(self, handle: Handle) -> None:
        """The request leaves within the next step (its blocks are freed); it yields no result."""
        if handle.seq is not None and handle.seq.seq_id in self.live:
            self.batch.cancel(handle.seq)

    def step(self) -> list[tuple[Handle, GenerationResult | None]]:
        """One engine step; (handle, result) for each request that finished in it (None: cancelled).
        A decode step launched ahead reports its finished requests at the next step."""
        done = []
        for seq in self.batch.step():
            handle = self.live.pop(seq.seq_id)
            result = None if seq.finish_reason == "cancelled" else build_result(self.engine, handle)
            done.append((handle, result))
        return done

    def abandon(self) -> list[Handle]:
        """Cancel everything in flight and run the steps that free it; the handles dropped."""
        handles = list(self.live.values())
        for handle in handles:
            self.batch.cancel(handle.seq)
        while self.live and self.batch.has_work:
            self.step()
        return handles


def generate_many(engine, requests: Iterable[GenerationRequest], *, cancelled=None) -> Iterator[tuple[int, Outcome]]:
    """Yield (index of the request, its result or error) as each finishes. `cancelled(index)`, if
    given, is asked before every step: True removes that request within the step (no result)."""
    session = BatchSession(engine)
    index_of: dict[int, int] = {}   # id(handle) -> index
    handles = []
    for index, outcome in enumerate(session.add_many(list(requests))):
        if isinstance(outcome, EngineError):
            yield index, outcome
            continue
        if isinstance(outcome, Exception):
            raise outcome   # a bug, not the request's fault
        index_of[id(outcome)] = index
        handles.append(outcome)
    while session.has_work:
        if cancelled is not None:
            for handle in handles:
                if not handle.finished and cancelled(index_of[id(handle)]):
                    session.cancel(handle)
        for handle, result in session.step():
            if result is not None:
                yield index_of[id(handle)], result


def build_result(engine, handle: Handle) -> GenerationResult:
    seq, request, telemetry = handle.seq, handle.request, handle.telemetry
    ids = list(seq.generated)
    text, telemetry.output_dropped_bytes = output_text(engine.codec, ids, request.sampling.stop)
    first, prompt_done, done = seq.first_scheduled_at, seq.prompt_done_at or seq.finished_at, seq.finished_at
    telemetry.prefill_s = prompt_done - first
    telemetry.decode_s = done - prompt_done
    telemetry.prefill_tokens_per_s = seq.prompt_len / telemetry.prefill_s if telemetry.prefill_s else 0.0
    telemetry.decode_tokens_per_s = (len(ids) - 1) / telemetry.decode_s if telemetry.decode_s and len(ids) > 1 else 0.0
    telemetry.total_s = done - handle.added_at
    telemetry.slot_wait_s = first - seq.arrived_at
    telemetry.running_s = done - first
    telemetry.preemptions = seq.preemptions
    telemetry.batch_size_mean = sum(seq.batch_sizes) / len(seq.batch_sizes) if seq.batch_sizes else None
    if seq.spec_steps:
        telemetry.spec_method = request.speculation.method
        telemetry.spec_steps = seq.spec_steps
        telemetry.spec_draft_tokens_offered = seq.spec_offered
        telemetry.spec_draft_tokens_accepted = seq.spec_accepted
        telemetry.acceptance_rate = seq.spec_accepted / seq.spec_offered
        telemetry.mean_accepted_length = (seq.spec_accepted + seq.spec_steps) / seq.spec_steps
        telemetry.acceptance_per_position = [a / o for a, o in zip(seq.spec_accepted_at, seq.spec_offered_at)]
    fingerprint = {**engine.fingerprint(request), "batched": True,
                   "compress_drafter_sha256": handle.compress_drafter_sha256 or None}
    return GenerationResult(
        text=text, token_ids=ids, output_sha256=sha256_hex(text.encode("utf-8")), token_ids_sha256=token_ids_sha256(ids),
        prompt_tokens=handle.prompt_tokens, effective_prompt_tokens=seq.prompt_len, generated_tokens=len(ids),
        finish_reason=seq.finish_reason, telemetry=telemetry, fingerprint=fingerprint,
    )
