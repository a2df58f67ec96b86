"""Cancel and retry: conditional UPDATEs over a batch or a list of job ids."""
from __future__ import annotations

from typing import Optional, Sequence

from sqlalchemy import insert, select, update

from batchd.db.models import Batch, Job, JobEvent, JobStatus
from batchd.db.session import session_scope
from batchd.db.types import utcnow
from batchd.jobs.progress import UnknownBatch

CANCELLABLE = (JobStatus.PENDING, JobStatus.QUEUED, JobStatus.RUNNING)
RETRYABLE = (JobStatus.FAILED, JobStatus.EXPIRED, JobStatus.CANCELLED)


def _job_filter(session, batch: Optional[str], job_ids: Optional[Sequence[int]]):
    if batch is not None:
        batch_id = session.scalar(select(Batch.id).where(Batch.name == batch))
        if batch_id is None:
            raise UnknownBatch(f"no batch named {batch!r}; `batchd status` lists them")
        return Job.batch_id == batch_id
    return Job.id.in_(list(job_ids or []))


def cancel(url: str, *, batch: Optional[str] = None, job_ids: Optional[Sequence[int]] = None) -> int:
    """pending/queued/running -> cancelled. A running job's worker finds it cancelled when it
    tries to save the result, and discards the result."""
    now = utcnow()
    with session_scope(url) as session:
        where = _job_filter(session, batch, job_ids)
        ids = list(session.scalars(select(Job.id).where(where, Job.status.in_(CANCELLABLE)).with_for_update()))
        if ids:
            session.execute(update(Job).where(Job.id.in_(ids), Job.status.in_(CANCELLABLE))
                            .values(status=JobStatus.CANCELLED, cancelled_at=now, lease_expires_at=None))
            session.execute(insert(JobEvent), [{"job_id": i, "event": "cancelled", "at": now} for i in ids])
        if batch is not None:
            session.execute(update(Batch).where(Batch.name == batch).values(cancelled_at=now))
    return len(ids)


def retry(url: str, *, batch: Optional[str] = None, job_ids: Optional[Sequence[int]] = None,
          statuses: Sequence[JobStatus] = (JobStatus.FAILED, JobStatus.EXPIRED),
          error_kind: Optional[str] = None) -> list[int]:
    """failed/expired/cancelled -> pending again (errors and the attempt count cleared); their ids."""
    statuses = [s for s in statuses if s in RETRYABLE]
    now = utcnow()
    with session_scope(url) as session:
        where = [_job_filter(session, batch, job_ids), Job.status.in_(statuses)]
        if error_kind:
            where.append(Job.error_kind == error_kind)
        ids = list(session.scalars(select(Job.id).where(*where).with_for_update()))
        if ids:
            session.execute(update(Job).where(Job.id.in_(ids), Job.status.in_(statuses)).values(
                status=JobStatus.PENDING, pending_at=now, queued_at=None, running_at=None, failed_at=None,
                expired_at=None, cancelled_at=None, expires_at=None, worker_id=None, lease_expires_at=None,
                error_kind=None, error_message=None, retryable=None, attempts=0))
            session.execute(insert(JobEvent), [{"job_id": i, "event": "retried", "at": now} for i in ids])
    return ids
