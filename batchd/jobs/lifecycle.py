"""A job's state changes, each one conditional UPDATE (compare-and-swap) plus its event.

Every transition names the state it expects (and, for a running job, the worker that holds
it); if the row is not in that state the UPDATE changes nothing and the caller learns it lost
the race. That is how a duplicate delivery does nothing, how a worker whose lease was taken
over cannot write a second result, and how a cancel beats a late finish.
"""
from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Optional

from sqlalchemy import insert, update
from sqlalchemy.orm import Session

from batchd.db.models import Job, JobEvent, JobStatus, Result
from batchd.db.session import session_scope
from batchd.db.types import utcnow


def add_event(session: Session, job_id: int, event: str, *, worker_id: Optional[str] = None,
              detail: Optional[str] = None, at: Optional[datetime] = None) -> None:
    session.execute(insert(JobEvent).values(job_id=job_id, event=event, worker_id=worker_id, detail=detail,
                                            at=at or utcnow()))


def claim(url: str, job_id: int, worker_id: str, lease_s: float) -> Optional[Job]:
    """queued -> running for this worker with a lease; the job, or None when it is not queued
    (a duplicate delivery, a cancelled job, another worker's job)."""
    now = utcnow()
    with session_scope(url) as session:
        claimed = session.execute(
            update(Job)
            .where(Job.id == job_id, Job.status == JobStatus.QUEUED)
            .values(status=JobStatus.RUNNING, running_at=now, worker_id=worker_id,
                    lease_expires_at=now + timedelta(seconds=lease_s), attempts=Job.attempts + 1)
        ).rowcount
        if claimed != 1:
            return None
        add_event(session, job_id, "running", worker_id=worker_id, at=now)
        return session.get(Job, job_id)


def renew_lease(url: str, job_id: int, worker_id: str, lease_s: float) -> bool:
    """Extend the lease of a job this worker runs; False when the job is no longer ours."""
    with session_scope(url) as session:
        return session.execute(
            update(Job)
            .where(Job.id == job_id, Job.status == JobStatus.RUNNING, Job.worker_id == worker_id)
            .values(lease_expires_at=utcnow() + timedelta(seconds=lease_s))
        ).rowcount == 1


def complete(url: str, job_id: int, worker_id: str, result: dict[str, Any]) -> bool:
    """running -> succeeded and the result row, in one transaction: both or neither."""
    now = utcnow()
    with session_scope(url) as session:
        done = session.execute(
            update(Job)
            .where(Job.id == job_id, Job.status == JobStatus.RUNNING, Job.worker_id == worker_id)
            .values(status=JobStatus.SUCCEEDED, succeeded_at=now, lease_expires_at=None,
                    error_kind=None, error_message=None, retryable=None)
        ).rowcount
        if done != 1:
            return False
        session.execute(insert(Result).values(job_id=job_id, created_at=now, **result))
        add_event(session, job_id, "succeeded", worker_id=worker_id, at=now)
        return True


def fail(url: str, job_id: int, worker_id: str, kind: str, message: str, retryable: bool) -> bool:
    """running -> failed with a kind and a message a person can act on."""
    now = utcnow()
    with session_scope(url) as session:
        done = session.execute(
            update(Job)
            .where(Job.id == job_id, Job.status == JobStatus.RUNNING, Job.worker_id == worker_id)
            .values(status=JobStatus.FAILED, failed_at=now, lease_expires_at=None, error_kind=kind,
                    error_message=message, retryable=retryable)
        ).rowcount
        if done == 1:
            add_event(session, job_id, "failed", worker_id=worker_id, detail=f"{kind}: {message}", at=now)
        return done == 1


def release(url: str, job_id: int, worker_id: str, reason: str, queue_lease_s: float) -> bool:
    """running -> queued, for a retry after a transient error (the retry message follows)."""
    now = utcnow()
    with session_scope(url) as session:
        done = session.execute(
            update(Job)
            .where(Job.id == job_id, Job.status == JobStatus.RUNNING, Job.worker_id == worker_id)
            .values(status=JobStatus.QUEUED, queued_at=now, worker_id=None,
                    lease_expires_at=now + timedelta(seconds=queue_lease_s))
        ).rowcount
        if done == 1:
            add_event(session, job_id, "released", worker_id=worker_id, detail=reason, at=now)
        return done == 1


def ignored_delivery(url: str, job_id: int, worker_id: str) -> Optional[str]:
    """Record a delivery that found the job not queued; its current status (None: no such job)."""
    with session_scope(url) as session:
        job = session.get(Job, job_id)
        if job is None:
            return None
        add_event(session, job_id, "delivery_ignored", worker_id=worker_id, detail=f"status was {job.status.value}")
        return job.status.value


def add_event_safely(url: str, job_id: int, event: str, worker_id: Optional[str], detail: Optional[str]) -> None:
    with session_scope(url) as session:
        add_event(session, job_id, event, worker_id=worker_id, detail=detail)
