"""A batch's history written through the service's own code, then placed on a chosen timeline.

Status, totals and the report read what workers leave in the database. To test them against a
known run (a 16-minute batch whose workers ran 11 s, a batch with speculation and compression),
`write_batch` submits the jobs with `submit_jobs`, claims them with `lifecycle.claim`, stores
results with `lifecycle.complete` (rows built by the runner's `result_row`) or failures with
`lifecycle.fail`, and then moves every timestamp of the batch (jobs, events, results) to the
offsets the test gives, in seconds before now.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import sqlalchemy as sa

from batchd.db.models import Job, JobEvent, JobStatus, Result
from batchd.db.session import session_scope
from batchd.db.types import utcnow
from batchd.engine.types import GenerationResult, Telemetry
from batchd.jobs import lifecycle
from batchd.jobs.inputs import JobInput
from batchd.jobs.runner import result_row
from batchd.jobs.submit import submit_jobs

WORKER = "test-worker@host:1"


@dataclass
class PastJob:
    custom_id: str
    prompt: str
    outcome: str = "succeeded"           # succeeded | failed | running | pending
    submitted_ago: float = 60.0          # seconds before now
    claimed_ago: Optional[float] = None  # None: never claimed
    finished_ago: Optional[float] = None
    prompt_tokens: int = 0
    effective_prompt_tokens: Optional[int] = None   # None: not compressed
    generated_tokens: int = 0
    prefill_s: float = 0.1
    decode_s: float = 0.5
    acceptance_per_position: list[float] = field(default_factory=list)
    error_kind: str = "bad_input"
    error_message: str = ""


def generation_result(job: PastJob) -> GenerationResult:
    text = f"summary of {job.custom_id}"
    effective = job.effective_prompt_tokens if job.effective_prompt_tokens is not None else job.prompt_tokens
    offered = 40 * len(job.acceptance_per_position)
    accepted = round(offered * sum(job.acceptance_per_position) / len(job.acceptance_per_position)) if offered else 0
    telemetry = Telemetry(
        prefill_s=job.prefill_s, decode_s=job.decode_s, total_s=job.prefill_s + job.decode_s,
        prefill_tokens_per_s=effective / job.prefill_s if job.prefill_s else 0.0,
        decode_tokens_per_s=max(job.generated_tokens - 1, 0) / job.decode_s if job.decode_s else 0.0,
        spec_method="lookup" if offered else "none", spec_steps=40 if offered else 0,
        spec_draft_tokens_offered=offered, spec_draft_tokens_accepted=accepted,
        acceptance_rate=accepted / offered if offered else None,
        acceptance_per_position=list(job.acceptance_per_position),
        compressed=job.effective_prompt_tokens is not None,
        compress_tokens_before=job.prompt_tokens if job.effective_prompt_tokens is not None else None)
    token_ids = list(range(job.generated_tokens))
    return GenerationResult(
        text=text, token_ids=token_ids, output_sha256=hashlib.sha256(text.encode()).hexdigest(),
        token_ids_sha256=hashlib.sha256(bytes(len(token_ids))).hexdigest(), prompt_tokens=job.prompt_tokens,
        effective_prompt_tokens=effective, generated_tokens=job.generated_tokens,
        finish_reason="length", telemetry=telemetry,
        fingerprint={"compress": "auto" if job.effective_prompt_tokens is not None else "off"})


def write_batch(settings, name: str, jobs: list[PastJob]) -> dict[str, int]:
    """The batch's jobs through submit, claim and complete/fail, then on their timeline; custom_id -> job id."""
    url = settings.database_url
    report = submit_jobs(settings, name, [JobInput(custom_id=j.custom_id, source="test", prompt=j.prompt)
                                          for j in jobs])
    ids = dict(zip([j.custom_id for j in jobs], report.job_ids))
    now = utcnow()
    for job in jobs:
        job_id = ids[job.custom_id]
        if job.claimed_ago is None:
            continue
        with session_scope(url) as session:
            session.execute(sa.update(Job).where(Job.id == job_id).values(status=JobStatus.QUEUED, queued_at=now))
        assert lifecycle.claim(url, job_id, WORKER, lease_s=600) is not None
        if job.outcome == "succeeded":
            row = result_row(generation_result(job), queue_wait_s=job.submitted_ago - job.claimed_ago,
                             worker_host="host", worker_id=WORKER, started_at=now, finished_at=now)
            assert lifecycle.complete(url, job_id, WORKER, row)
        elif job.outcome == "failed":
            assert lifecycle.fail(url, job_id, WORKER, job.error_kind, job.error_message, False)
    _move_to_timeline(url, jobs, ids, now)
    return ids


def _move_to_timeline(url: str, jobs: list[PastJob], ids: dict[str, int], now) -> None:
    def ago(seconds: Optional[float]):
        return None if seconds is None else now - timedelta(seconds=seconds)

    with session_scope(url) as session:
        for job in jobs:
            job_id = ids[job.custom_id]
            submitted, claimed, finished = ago(job.submitted_ago), ago(job.claimed_ago), ago(job.finished_ago)
            values = {"created_at": submitted, "pending_at": submitted}
            if claimed is not None:
                values.update(queued_at=submitted, running_at=claimed)
            if job.outcome in ("succeeded", "failed"):
                values[f"{job.outcome}_at"] = finished
            session.execute(sa.update(Job).where(Job.id == job_id).values(**values))
            for event, at in (("submitted", submitted), ("running", claimed),
                              (job.outcome, finished if job.outcome in ("succeeded", "failed") else None)):
                if at is not None:
                    session.execute(sa.update(JobEvent).where(JobEvent.job_id == job_id, JobEvent.event == event)
                                    .values(at=at))
            if job.outcome == "succeeded":
                session.execute(sa.update(Result).where(Result.job_id == job_id).values(
                    created_at=finished, engine_started_at=claimed, engine_finished_at=finished))
