"""How a delivery that went wrong ends: every job is terminal after at most `max_attempts`.

A worker's delivery of a job can end in an exception instead of a result. What happens next
depends on whether trying again can help (batchd.db.errors.is_transient):

- transient (the database was away, the batch handed the job back after running out of
  device memory, the worker is shutting down): the job goes back to the queue for another
  delivery, unless this was its `max_attempts`-th claim; then it fails for good (retryable:
  `batchd retry` runs it again), with the last reason in its message;
- permanent (a value its column cannot hold, a constraint, a bug): the job fails at once as
  `internal`; another delivery would fail the same way (a poison loop).

A job whose row cannot even be claimed (the claim statement itself fails permanently) fails
while still queued. Writing the failure can itself fail when the database is away; the job
then keeps its lease, the relay requeues it when the lease runs out, and after `max_attempts`
claims the relay fails it as `worker_lost` (batchd.relay): terminal either way.
"""
from __future__ import annotations

import logging

from sqlalchemy import Text, bindparam, insert, update

from batchd.config import Settings
from batchd.db.errors import is_transient, one_line
from batchd.db.models import Job, JobEvent, JobStatus
from batchd.db.session import db_engine
from batchd.db.types import UTCDateTime, utcnow
from batchd.jobs import lifecycle

log = logging.getLogger(__name__)

OUT_OF_MEMORY = "out of device memory"   # the engine loop's requeue reasons say so (batchd.jobs.engine_loop)


def hand_back(settings: Settings, job_id: int, worker_id: str, attempts: int, reason: str) -> bool:
    """After a transient failure: True when the job went back to the queue (the caller retries
    the task), False when this was its last allowed delivery and it failed for good."""
    url = settings.database_url
    if attempts < settings.max_attempts:
        try:
            lifecycle.release(url, job_id, worker_id, reason, settings.queue_lease_s)
        except Exception as exc:
            if not is_transient(exc):
                raise
            log.warning("job %s: could not release it (%s); the relay requeues it when its lease expires", job_id,
                        one_line(exc))
        return True
    kind = "oom" if OUT_OF_MEMORY in reason else "internal"
    message = (f"gave up after {attempts} deliveries (BATCHD_MAX_ATTEMPTS={settings.max_attempts}); the last ended "
               f"with: {reason}; `batchd retry` runs it again")
    _fail(settings, job_id, worker_id, kind, message, retryable=True)
    return False


def settle_exception(settings: Settings, job_id: int, worker_id: str, attempts: int, exc: BaseException) -> bool:
    """A claimed job's delivery ended in `exc`: True when the job went back to the queue (retry
    the task), False when it failed (permanent errors at once, transient ones after the last
    allowed delivery)."""
    if is_transient(exc):
        return hand_back(settings, job_id, worker_id, attempts, f"the database was unavailable ({one_line(exc)})")
    log.error("job %s: permanent error; the job fails instead of running again", job_id, exc_info=exc)
    _fail(settings, job_id, worker_id, "internal", permanent_message(exc), retryable=False)
    return False


def permanent_message(exc: BaseException) -> str:
    from sqlalchemy.exc import SQLAlchemyError

    if isinstance(exc, SQLAlchemyError):
        return (f"the database refused to store this job ({one_line(exc)}); running it again would fail the same "
                "way: check the job's params against the README's ranges, then `batchd retry` it")
    return f"{one_line(exc)} (a bug; the worker log has the traceback)"


FAIL_UNCLAIMABLE = (update(Job.__table__).where(Job.__table__.c.id == bindparam("job"),
                                                Job.__table__.c.status == JobStatus.QUEUED)
                    .values(status=JobStatus.FAILED, failed_at=bindparam("now", type_=UTCDateTime()), lease_expires_at=None,
                            error_kind="internal", error_message=bindparam("message", type_=Text), retryable=False))


def fail_unclaimable(settings: Settings, job_id: int, exc: BaseException) -> bool:
    """The claim of a queued job failed permanently (its row cannot be read or moved): fail it
    as it is, so that no later delivery meets the same error. True when it was failed."""
    log.error("job %s: cannot be claimed; failed as it is", job_id, exc_info=exc)
    message = f"the job's row cannot be claimed ({one_line(exc)}); fix the row, then `batchd retry` it"
    try:
        now = utcnow()
        with db_engine(settings.database_url).begin() as connection:
            moved = connection.execute(FAIL_UNCLAIMABLE, {"job": job_id, "now": now, "message": message}).rowcount
            if moved:
                connection.execute(insert(JobEvent), {"job_id": job_id, "event": "failed", "at": now,
                                                      "detail": f"internal: {message}"})
            return moved == 1
    except Exception as error:
        log.warning("job %s: could not fail it either (%s)", job_id, one_line(error))
        return False


def _fail(settings: Settings, job_id: int, worker_id: str, kind: str, message: str, retryable: bool) -> None:
    try:
        lifecycle.fail(settings.database_url, job_id, worker_id, kind, message, retryable)
        log.info("job %s failed: %s: %s", job_id, kind, message)
    except Exception as exc:
        log.warning("job %s: could not record its failure (%s); the relay ends it when its lease expires",
                    job_id, one_line(exc))
