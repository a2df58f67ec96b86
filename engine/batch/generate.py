"""Requests in, results out as each finishes: the text side of the batch engine.

    for index, outcome in generate_many(engine, requests):
        ...   # outcome: a GenerationResult, or the EngineError that failed that request alone

Each request is encoded (and compressed by PFlash when it asks) before it joins the batch; a
request that cannot run fails alone. Results carry the same fields as `Engine.generate`'s.
"""
from __future__ import annotations

import time
from typing import Iterable, Iterator, Union

from batchd.engine.batch.sequence import Sequence
from batchd.engine.errors import EngineError
from batchd.engine.pflash import ensure_target_resident
from batchd.engine.hashes import sha256_hex, token_ids_sha256
from batchd.engine.stopping import cut_at_stop_string
from batchd.engine.types import GenerationRequest, GenerationResult, Telemetry

Outcome = Union[GenerationResult, EngineError]


def generate_many(engine, requests: Iterable[GenerationRequest], *, cancelled=None) -> Iterator[tuple[int, Outcome]]:
    """Yield (index of the request, its result or error) as each finishes. `cancelled(index)`, if
    given, is asked before every step: True removes that request within the step (no result)."""
    ensure_target_resident(engine)   # an earlier job's failed unpark is retried before these
    batch = engine.batch_engine()
    live: dict[int, tuple[int, Sequence, Telemetry, int, GenerationRequest, float]] = {}
    for index, request in enumerate(requests):
        started = time.perf_counter()
        telemetry = Telemetry(device=str(engine.device), notes=list(engine.notes) + batch.notes)
        try:
            prompt_ids = engine.codec.encode_request(request.prompt, request.messages, request.chat)
            effective = engine.compress(prompt_ids, request, telemetry)
            seq = batch.submit(effective, request)
        except EngineError as exc:
            yield index, exc
            continue
        live[seq.seq_id] = (index, seq, telemetry, len(prompt_ids), request, started)
    while batch.has_work:
        if cancelled is not None:
            for index, seq, *_ in live.values():
                if cancelled(index):
                    batch.cancel(seq)
        for seq in batch.step():
            index, _, telemetry, prompt_tokens, request, started = live.pop(seq.seq_id)
            if seq.finish_reason != "cancelled":
                yield index, build_result(engine, seq, request, telemetry, prompt_tokens, started)


def build_result(engine, seq: Sequence, request: GenerationRequest, telemetry: Telemetry, prompt_tokens: int,
                 started: float) -> GenerationResult:
    ids = list(seq.generated)
    text = cut_at_stop_string(engine.codec.decode(ids), request.sampling.stop)
    first, prompt_done, done = seq.first_scheduled_at, seq.prompt_done_at or seq.finished_at, seq.finished_at
    telemetry.prefill_s = prompt_done - first
    telemetry.decode_s = done - prompt_done
    telemetry.prefill_tokens_per_s = seq.prompt_len / telemetry.prefill_s if telemetry.prefill_s else 0.0
    telemetry.decode_tokens_per_s = (len(ids) - 1) / telemetry.decode_s if telemetry.decode_s and len(ids) > 1 else 0.0
    telemetry.total_s = done - started
    if seq.spec_steps:
        telemetry.spec_method = request.speculation.method
        telemetry.spec_steps = seq.spec_steps
        telemetry.spec_draft_tokens_offered = seq.spec_offered
        telemetry.spec_draft_tokens_accepted = seq.spec_accepted
        telemetry.acceptance_rate = seq.spec_accepted / seq.spec_offered
        telemetry.mean_accepted_length = (seq.spec_accepted + seq.spec_steps) / seq.spec_steps
        telemetry.acceptance_per_position = [a / o for a, o in zip(seq.spec_accepted_at, seq.spec_offered_at)]
    if seq.batch_sizes:
        telemetry.notes.append(f"batch: mean {sum(seq.batch_sizes) / len(seq.batch_sizes):.1f} sequences a decode "
                               f"step, {seq.preemptions} preemptions, "
                               f"{seq.first_scheduled_at - seq.arrived_at:.3f} s waiting for a slot")
    return GenerationResult(
        text=text, token_ids=ids, output_sha256=sha256_hex(text.encode("utf-8")), token_ids_sha256=token_ids_sha256(ids),
        prompt_tokens=prompt_tokens, effective_prompt_tokens=seq.prompt_len, generated_tokens=len(ids),
        finish_reason=seq.finish_reason, telemetry=telemetry, fingerprint={**engine.fingerprint(request), "batched": True},
    )
