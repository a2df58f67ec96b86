"""A job's state changes, each one conditional UPDATE (compare-and-swap) plus its event.

Every transition names the state it expects (and, for a running job, the worker that holds
it); if the row is not in that state the UPDATE changes nothing and the caller learns it lost
the race. That is how a duplicate delivery does nothing, how a worker whose lease was taken
over cannot write a second result, and how a cancel beats a late finish.

On PostgreSQL a transition is ONE statement, run as its own transaction (autocommit), so it
costs one round trip; the event and the result row are inserted only if the UPDATE matched:

    WITH moved  AS (UPDATE jobs SET ... WHERE id = :job AND status = 'running'
                                              AND worker_id = :worker RETURNING ...),
         event  AS (INSERT INTO job_events (...) SELECT moved.id, ... FROM moved),
         result AS (INSERT INTO results (...) SELECT moved.id, ... FROM moved)   -- complete
    SELECT ... FROM moved

SQLite has no data-modifying WITH: there the same UPDATE ... RETURNING and INSERTs run one
after another in one BEGIN IMMEDIATE transaction. Either way: all of it or none of it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

from sqlalchemy import Boolean, Row, String, Text, bindparam, cast, insert, literal, select, update
from sqlalchemy.sql import Select, Update

from batchd.db.models import Job, JobEvent, JobStatus, Result
from batchd.db.session import db_engine, is_postgresql, statement_engine
from batchd.db.types import UTCDateTime, utcnow

JOBS, EVENTS, RESULTS = Job.__table__, JobEvent.__table__, Result.__table__

# What the worker needs from a claimed job (and the tests read): no second query for it. The
# JSON columns come back as text, parsed by the worker (batchd.jobs.job_request): SQLite keeps
# any text a person INSERTs there, and a parse error inside the claim would undo the claim on
# every delivery instead of failing the job.
CLAIMED_COLUMNS = (JOBS.c.id, JOBS.c.prompt, cast(JOBS.c.messages, Text).label("messages"),
                   cast(JOBS.c.params, Text).label("params"), JOBS.c.status, JOBS.c.attempts,
                   JOBS.c.queued_at, JOBS.c.running_at)
RESULT_COLUMNS = tuple(c for c in RESULTS.columns if c.name != "job_id")
EVENT_COLUMNS = ("job_id", "event", "worker_id", "detail", "at")

# Parameters of every transition; their names differ from column names (SQLAlchemy reserves
# those for its own SET parameters).
JOB, WORKER, NOW = bindparam("job"), bindparam("worker", type_=String), bindparam("now", type_=UTCDateTime())
DETAIL, LEASE_UNTIL = bindparam("detail", type_=Text), bindparam("lease_until", type_=UTCDateTime())

INSERT_EVENT = insert(EVENTS)
INSERT_RESULT = insert(RESULTS)


@dataclass(frozen=True)
class Transition:
    """A compare-and-swap UPDATE of jobs, the event it records for each job it moved, and for
    `complete` the result row. `durable=False`: a crash may lose it (see `claim`)."""

    event: Optional[str]
    cas: Update  # UPDATE jobs ... WHERE <expected state> RETURNING ...
    with_result: bool = False
    durable: bool = True
    single_statement: Select = field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "single_statement", self._single_statement())

    def _single_statement(self) -> Select:
        """The PostgreSQL form: the UPDATE and its INSERTs as one WITH statement."""
        moved = self.cas.cte("moved")
        inserts = []
        if self.event is not None:
            inserts.append(insert(EVENTS).from_select(
                EVENT_COLUMNS, select(moved.c.id, literal(self.event, String), WORKER, DETAIL, NOW)).cte("event"))
        if self.with_result:
            values = [bindparam(f"result_{c.name}", type_=c.type) for c in RESULT_COLUMNS]
            inserts.append(insert(RESULTS).from_select(
                ["job_id", *(c.name for c in RESULT_COLUMNS)], select(moved.c.id, *values)).cte("result"))
        return select(moved).add_cte(*inserts)

    def run(self, url: str, params: dict[str, Any], result: Optional[dict[str, Any]] = None) -> list[Row]:
        """The RETURNING rows of the jobs that swapped (none: the swap did not happen)."""
        params = {"worker": None, "detail": None, **params}
        if is_postgresql(url):
            if self.with_result:
                params.update({f"result_{c.name}": result.get(c.name) for c in RESULT_COLUMNS},
                              result_created_at=params["now"])
            with statement_engine(url, durable=self.durable).connect() as connection:
                return connection.execute(self.single_statement, params).all()
        with db_engine(url).begin() as connection:
            rows = connection.execute(self.cas, params).all()
            if rows and self.event is not None:
                connection.execute(INSERT_EVENT, [{"job_id": row.id, "event": self.event, "worker_id": params["worker"],
                                                   "detail": params["detail"], "at": params["now"]} for row in rows])
            if rows and self.with_result:
                [row] = rows  # a result belongs to one job
                connection.execute(INSERT_RESULT, {"job_id": row.id, "created_at": params["now"], **result})
            return rows


def _running_job_of_worker(**values) -> Update:
    """The swap out of `running`, only for the worker that holds the job."""
    return (update(JOBS).where(JOBS.c.id == JOB, JOBS.c.status == JobStatus.RUNNING, JOBS.c.worker_id == WORKER)
            .values(**values).returning(JOBS.c.id))


CLAIM = Transition("running", durable=False, cas=(
    update(JOBS).where(JOBS.c.id == JOB, JOBS.c.status == JobStatus.QUEUED)
    .values(status=JobStatus.RUNNING, running_at=NOW, worker_id=WORKER, lease_expires_at=LEASE_UNTIL,
            attempts=JOBS.c.attempts + 1)
    .returning(*CLAIMED_COLUMNS)))
RENEW_LEASE = Transition(None, durable=False, cas=_running_job_of_worker(lease_expires_at=LEASE_UNTIL))
JOBS_IN = bindparam("jobs", expanding=True)
RENEW_LEASES = Transition(None, durable=False, cas=(
    update(JOBS).where(JOBS.c.id.in_(JOBS_IN), JOBS.c.status == JobStatus.RUNNING, JOBS.c.worker_id == WORKER)
    .values(lease_expires_at=LEASE_UNTIL).returning(JOBS.c.id)))
STILL_OURS = select(JOBS.c.id).where(JOBS.c.id.in_(JOBS_IN), JOBS.c.status == JobStatus.RUNNING,
                                     JOBS.c.worker_id == WORKER)
COMPLETE = Transition("succeeded", with_result=True, cas=_running_job_of_worker(
    status=JobStatus.SUCCEEDED, succeeded_at=NOW, lease_expires_at=None, error_kind=None, error_message=None,
    retryable=None))
FAIL = Transition("failed", cas=_running_job_of_worker(
    status=JobStatus.FAILED, failed_at=NOW, lease_expires_at=None, error_kind=bindparam("kind", type_=String),
    error_message=bindparam("message", type_=Text), retryable=bindparam("may_retry", type_=Boolean)))
RELEASE = Transition("released", cas=_running_job_of_worker(
    status=JobStatus.QUEUED, queued_at=NOW, worker_id=None, lease_expires_at=LEASE_UNTIL))


def claim(url: str, job_id: int, worker_id: str, lease_s: float) -> Optional[Row]:
    """queued -> running for this worker with a lease; the job's `CLAIMED_COLUMNS`, or None
    when it is not queued (a duplicate delivery, a cancelled job, another worker's job).

    The claim does not wait for PostgreSQL's WAL flush. That is safe: if a database crash
    loses it, the job is `queued` again with its queue lease (the relay republishes it), and
    this worker's final compare-and-swap finds the job not running under its id, so its
    result is discarded and the job runs again. Submits, results and failures stay durable."""
    now = utcnow()
    claimed = CLAIM.run(url, {"job": job_id, "worker": worker_id, "now": now,
                              "lease_until": now + timedelta(seconds=lease_s)})
    return claimed[0] if claimed else None


def renew_lease(url: str, job_id: int, worker_id: str, lease_s: float) -> bool:
    """Extend the lease of a job this worker runs; False when the job is no longer ours.
    Not flushed before it returns, like the claim (a lost renewal at worst requeues the job)."""
    now = utcnow()
    return bool(RENEW_LEASE.run(url, {"job": job_id, "worker": worker_id, "now": now,
                                      "lease_until": now + timedelta(seconds=lease_s)}))


def renew_leases(url: str, job_ids: list[int], worker_id: str, lease_s: float) -> set[int]:
    """`renew_lease` for many jobs in one statement; the ids still ours (renewed)."""
    if not job_ids:
        return set()
    now = utcnow()
    rows = RENEW_LEASES.run(url, {"jobs": list(job_ids), "worker": worker_id, "now": now,
                                  "lease_until": now + timedelta(seconds=lease_s)})
    return {row.id for row in rows}


def still_ours(url: str, job_ids: list[int], worker_id: str) -> set[int]:
    """Of `job_ids`, those still running under this worker (a read: the others were cancelled,
    expired or taken over, and their work should stop)."""
    if not job_ids:
        return set()
    with db_engine(url).connect() as connection:
        return set(connection.execute(STILL_OURS, {"jobs": list(job_ids), "worker": worker_id}).scalars())


def complete(url: str, job_id: int, worker_id: str, result: dict[str, Any]) -> bool:
    """running -> succeeded and the result row, in one transaction: both or neither."""
    unknown = set(result) - {c.name for c in RESULT_COLUMNS}
    assert not unknown, f"not columns of results: {sorted(unknown)}"
    return bool(COMPLETE.run(url, {"job": job_id, "worker": worker_id, "now": utcnow()}, result))


def fail(url: str, job_id: int, worker_id: str, kind: str, message: str, retryable: bool) -> bool:
    """running -> failed with a kind and a message a person can act on."""
    return bool(FAIL.run(url, {"job": job_id, "worker": worker_id, "now": utcnow(), "kind": kind, "message": message,
                               "may_retry": retryable, "detail": f"{kind}: {message}"}))


def release(url: str, job_id: int, worker_id: str, reason: str, queue_lease_s: float) -> bool:
    """running -> queued, for a retry after a transient error (the retry message follows)."""
    now = utcnow()
    return bool(RELEASE.run(url, {"job": job_id, "worker": worker_id, "now": now, "detail": reason,
                                  "lease_until": now + timedelta(seconds=queue_lease_s)}))


# INSERT ... SELECT ... RETURNING: the event and the status it names, in one statement
IGNORED_DELIVERY = (
    insert(EVENTS).from_select(EVENT_COLUMNS, select(
        JOBS.c.id, literal("delivery_ignored", String), WORKER, literal("status was ", Text) + JOBS.c.status, NOW)
        .where(JOBS.c.id == JOB))
    .returning(EVENTS.c.detail))


def ignored_delivery(url: str, job_id: int, worker_id: str) -> Optional[str]:
    """Record a delivery that found the job not queued; its current status (None: no such job)."""
    with db_engine(url).begin() as connection:
        detail = connection.execute(IGNORED_DELIVERY, {"job": job_id, "worker": worker_id, "now": utcnow()}).scalar()
    return None if detail is None else detail.removeprefix("status was ")


def add_event(url: str, job_id: int, event: str, worker_id: Optional[str], detail: Optional[str]) -> None:
    """An event that goes with no transition (a discarded result), in its own transaction."""
    with db_engine(url).begin() as connection:
        connection.execute(INSERT_EVENT, {"job_id": job_id, "event": event, "worker_id": worker_id, "detail": detail,
                                          "at": utcnow()})
