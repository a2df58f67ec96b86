"""A job's history: its row and every event the service recorded for it, oldest first.

`job_events` is append-only: each transition (submitted, queued, running, succeeded, failed,
released, requeued, cancelled, expired, retried, ...) and each ignored delivery, with the worker
and a detail (a failure's kind and message, a requeue's reason)."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Optional

from sqlalchemy import select

from batchd.db.models import Batch, Job, JobEvent, JobStatus


class UnknownJob(LookupError):
    pass


@dataclass(frozen=True)
class JobHistory:
    job_id: int
    batch: str
    custom_id: str
    status: str
    attempts: int
    events: list[tuple[datetime, str, Optional[str], Optional[str]]]   # (at, event, worker_id, detail)


def job_history(url: str, job_id: Optional[int] = None, *, batch: Optional[str] = None,
                custom_id: Optional[str] = None) -> JobHistory:
    """By job id, or by batch name and custom_id."""
    from batchd.db.session import read_scope

    with read_scope(url) as session:
        query = select(Job.id, Batch.name, Job.custom_id, Job.status, Job.attempts).join(Batch, Batch.id == Job.batch_id)
        if job_id is not None:
            row = session.execute(query.where(Job.id == job_id)).first()
            missing = f"no job {job_id}; `batchd export --batch NAME` lists a batch's job ids"
        else:
            row = session.execute(query.where(Batch.name == batch, Job.custom_id == custom_id)).first()
            missing = f"no job {custom_id!r} in batch {batch!r}; `batchd results --batch {batch}` lists its jobs"
        if row is None:
            raise UnknownJob(missing)
        events = session.execute(select(JobEvent.at, JobEvent.event, JobEvent.worker_id, JobEvent.detail)
                                 .where(JobEvent.job_id == row.id).order_by(JobEvent.at, JobEvent.id)).all()
    return JobHistory(job_id=row.id, batch=row.name, custom_id=row.custom_id, status=JobStatus(row.status).value,
                      attempts=row.attempts, events=[tuple(event) for event in events])
