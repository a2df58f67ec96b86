"""Cancel, retry and delete: conditional UPDATEs (or a DELETE) over a batch or a list of job ids.

A retry puts finished jobs back to `pending`, optionally with param overrides (`--compress
auto` for a `too_long` job). The error it clears stays in the job's history: the `retried`
event says what the job was and why. A job whose input cannot run (it failed `bad_input`, and
the overrides do not fix it) is not retried: running it again could only fail again, with a
worse message; the person fixes the input and submits it with `--replace`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from sqlalchemy import delete, func, insert, select, update

from batchd.db.models import UNFINISHED, Batch, Job, JobEvent, JobStatus
from batchd.db.session import session_scope
from batchd.db.types import utcnow
from batchd.engine.errors import BadInputError
from batchd.jobs.params import validate_input, validate_params
from batchd.jobs.progress import UnknownBatch

CANCELLABLE = (JobStatus.PENDING, JobStatus.QUEUED, JobStatus.RUNNING)
RETRYABLE = (JobStatus.FAILED, JobStatus.EXPIRED, JobStatus.CANCELLED)
RETRY_CHUNK = 1000   # the ids of one UPDATE ... WHERE id IN (...)


class BatchNotFinished(Exception):
    """A batch that still has jobs to run cannot be deleted without --force."""


def _job_filter(session, batch: Optional[str], job_ids: Optional[Sequence[int]]):
    if batch is not None:
        batch_id = session.scalar(select(Batch.id).where(Batch.name == batch))
        if batch_id is None:
            raise UnknownBatch(f"no batch named {batch!r}; `batchd status` lists them")
        return Job.batch_id == batch_id
    return Job.id.in_(list(job_ids or []))


@dataclass(frozen=True)
class CancelledJob:
    id: int
    model: Optional[str]
    was: JobStatus   # a `queued` job's message waits in its model's queue (Publisher.remove_messages)


def cancel(url: str, *, batch: Optional[str] = None, job_ids: Optional[Sequence[int]] = None) -> list[CancelledJob]:
    """pending/queued/running -> cancelled. A running job's worker finds it cancelled when it
    tries to save the result, and discards the result."""
    now = utcnow()
    with session_scope(url) as session:
        where = _job_filter(session, batch, job_ids)
        rows = session.execute(select(Job.id, Job.model, Job.status).where(where, Job.status.in_(CANCELLABLE))
                               .with_for_update()).all()
        ids = [row.id for row in rows]
        if ids:
            session.execute(update(Job).where(Job.id.in_(ids), Job.status.in_(CANCELLABLE))
                            .values(status=JobStatus.CANCELLED, cancelled_at=now, lease_expires_at=None))
            session.execute(insert(JobEvent), [{"job_id": i, "event": "cancelled", "at": now} for i in ids])
        if batch is not None:
            session.execute(update(Batch).where(Batch.name == batch).values(cancelled_at=now))
    return [CancelledJob(row.id, row.model, JobStatus(row.status)) for row in rows]


@dataclass
class RetryReport:
    retried: list[int] = field(default_factory=list)
    not_retried: list[tuple[str, str]] = field(default_factory=list)  # (custom_id, why): its input cannot run


def retry(url: str, *, batch: Optional[str] = None, job_ids: Optional[Sequence[int]] = None,
          statuses: Sequence[JobStatus] = (JobStatus.FAILED, JobStatus.EXPIRED),
          error_kind: Optional[str] = None, params: Optional[dict[str, Any]] = None) -> RetryReport:
    """failed/expired/cancelled -> pending again, errors and the attempt count cleared, `params`
    over each job's own; an event per job keeps what it cleared."""
    overrides = validate_params(params or {})   # a bad override is the person's mistake: raises
    statuses = [s for s in statuses if s in RETRYABLE]
    now = utcnow()
    report = RetryReport()
    with session_scope(url) as session:
        where = [_job_filter(session, batch, job_ids), Job.status.in_(statuses)]
        if error_kind:
            where.append(Job.error_kind == error_kind)
        jobs = session.execute(select(Job.id, Job.custom_id, Job.status, Job.params, Job.error_kind,
                                      Job.error_message).where(*where).order_by(Job.id).with_for_update()).all()
        inputs = _inputs_of(session, [job.id for job in jobs if job.error_kind == "bad_input"])
        events, new_params = [], {}
        for job in jobs:
            merged = {**(job.params or {}), **overrides}
            try:
                merged = validate_params(merged)
                if job.id in inputs:
                    validate_input(*inputs[job.id], merged)
            except BadInputError as exc:
                report.not_retried.append((job.custom_id, job.error_message if job.id in inputs else exc.message))
                continue
            report.retried.append(job.id)
            new_params[job.id] = merged
            events.append({"job_id": job.id, "event": "retried", "at": now, "detail": _what_it_was(job, overrides)})
        reset = dict(status=JobStatus.PENDING, pending_at=now, queued_at=None, running_at=None, failed_at=None,
                     expired_at=None, cancelled_at=None, expires_at=None, worker_id=None, lease_expires_at=None,
                     error_kind=None, error_message=None, retryable=None, attempts=0)
        if overrides:
            for job_id, merged in new_params.items():
                session.execute(update(Job).where(Job.id == job_id).values(params=merged, **reset))
        else:
            for start in range(0, len(report.retried), RETRY_CHUNK):
                session.execute(update(Job).where(Job.id.in_(report.retried[start:start + RETRY_CHUNK]))
                                .values(**reset))
        if events:
            session.execute(insert(JobEvent), events)
    return report


def _inputs_of(session, job_ids: list[int]) -> dict[int, tuple[Any, Any]]:
    """(prompt, messages) of jobs whose input failed, to check again (read only for those:
    prompts can be long)."""
    if not job_ids:
        return {}
    rows = session.execute(select(Job.id, Job.prompt, Job.messages).where(Job.id.in_(job_ids))).all()
    return {row.id: (row.prompt, row.messages) for row in rows}


def _what_it_was(job, overrides: dict[str, Any]) -> str:
    """The `retried` event's detail: the state and error the retry clears, and its overrides."""
    detail = f"was {job.status.value}"
    if job.error_kind or job.error_message:
        detail += f": {job.error_kind or ''}: {job.error_message or ''}"
    if overrides:
        detail += "; retried with " + ", ".join(f"{key}={value!r}" for key, value in overrides.items())
    return detail


def delete_batch(url: str, name: str, *, force: bool = False) -> int:
    """Delete a batch with its jobs, results and events (the foreign keys cascade); the number of
    jobs it held. Refused while jobs are unfinished, unless `force` (a worker running one then
    finds it gone and discards its result)."""
    with session_scope(url) as session:
        batch_id = session.scalar(select(Batch.id).where(Batch.name == name).with_for_update())
        if batch_id is None:
            raise UnknownBatch(f"no batch named {name!r}; `batchd status` lists them")
        counts = dict(session.execute(select(Job.status, func.count()).where(Job.batch_id == batch_id)
                                      .group_by(Job.status)).all())
        unfinished = sum(n for status, n in counts.items() if status in UNFINISHED)
        if unfinished and not force:
            raise BatchNotFinished(f"batch {name!r} has {unfinished} unfinished job(s): cancel them first "
                                   f"(`batchd cancel --batch {name}`) or delete with --force")
        session.execute(delete(Batch).where(Batch.id == batch_id))
    return sum(counts.values())
