"""A job's state changes, each one conditional UPDATE (compare-and-swap) plus its event.

Every transition names the state it expects (and, for a running job, the worker that holds
it); if the row is not in that state the UPDATE changes nothing and the caller learns it lost
the race. That is how a duplicate delivery does nothing, how a worker whose lease was taken
over cannot write a second result, and how a cancel beats a late finish.
"""
from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Optional

from sqlalchemy import insert, text, update
from sqlalchemy.orm import Session

from batchd.db.models import Job, JobEvent, JobStatus, Result
from batchd.db.session import session_scope
from batchd.db.types import utcnow


# Core INSERTs with the values as parameters: compiled once, not rebuilt per job
INSERT_EVENT = insert(JobEvent.__table__)
INSERT_RESULT = insert(Result.__table__)


def add_event(session: Session, job_id: int, event: str, *, worker_id: Optional[str] = None,
              detail: Optional[str] = None, at: Optional[datetime] = None) -> None:
    session.execute(INSERT_EVENT, {"job_id": job_id, "event": event, "worker_id": worker_id, "detail": detail,
                                   "at": at or utcnow()})


def relax_commit(session: Session) -> None:
    """PostgreSQL: do not wait for this transaction's WAL flush. For a claim or a lease renewal
    that is safe: if a crash loses it, the job is `queued` again and the worker's final
    compare-and-swap fails, so its result is discarded and the job runs again. Submits,
    results and failures keep durable commits."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SET LOCAL synchronous_commit TO OFF"))


def claim(url: str, job_id: int, worker_id: str, lease_s: float) -> Optional[Job]:
    """queued -> running for this worker with a lease; the job, or None when it is not queued
    (a duplicate delivery, a cancelled job, another worker's job). One UPDATE ... RETURNING."""
    now = utcnow()
    with session_scope(url) as session:
        relax_commit(session)
        job = session.scalars(
            update(Job)
            .where(Job.id == job_id, Job.status == JobStatus.QUEUED)
            .values(status=JobStatus.RUNNING, running_at=now, worker_id=worker_id,
                    lease_expires_at=now + timedelta(seconds=lease_s), attempts=Job.attempts + 1)
            .returning(Job)
        ).one_or_none()
        if job is None:
            return None
        add_event(session, job_id, "running", worker_id=worker_id, at=now)
        return job


def renew_lease(url: str, job_id: int, worker_id: str, lease_s: float) -> bool:
    """Extend the lease of a job this worker runs; False when the job is no longer ours."""
    with session_scope(url) as session:
        relax_commit(session)
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
        session.execute(INSERT_RESULT, {"job_id": job_id, "created_at": now, **result})
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
