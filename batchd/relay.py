"""The relay: the database is the record, Redis only carries ids, and this keeps them agreeing.

Each pass:
1. expires pending/queued jobs whose deadline (`expires_at`) passed;
   and takes `queued` rows that no publisher wrote back to `pending`: batchd always gives a
   queued job a queue lease in the statement that queues it, so a `queued` row without one
   was inserted (or set) by SQL and has no message anywhere;
2. publishes `pending` jobs (written by SQL INSERT, or by a submit that could not reach the
   broker) and marks them `queued`;
3. requeues `running` jobs whose worker lease expired (the worker was killed or lost) and
   republishes them; after `max_attempts` losses the job fails as `worker_lost`;
4. republishes `queued` jobs whose queue lease expired when their model's Redis list holds
   fewer messages than there are queued jobs: a message was lost (a broker restart without
   persistence, a purge), and at most that many oldest jobs are sent again;
5. when the broker lost everything (it restarted empty, or was flushed), does step 4 at once for
   every queued job, leases or not, so that workers do not idle until the queue leases run out.
   It knows by a mark it keeps in the broker (`<prefix>.broker-mark`): gone with the data, it is
   set again once the queues are whole. On a fresh broker this finds nothing missing.

PostgreSQL: rows are taken with FOR UPDATE SKIP LOCKED, so any number of relays share the work.
SQLite: every transaction is BEGIN IMMEDIATE (one writer at a time), so one relay is correct and
more are merely redundant. A job published twice is harmless: the second claim finds it taken.

Everything it does is logged at INFO with the job ids (`batchd relay` and `batchd worker` show
INFO of this logger at the default level), and counted in its Prometheus metrics when given
(batchd.metrics.RelayMetrics: `--metrics-port`).
"""
from __future__ import annotations

import logging
import threading
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, Optional

from sqlalchemy import func, insert, select, update

from batchd.config import Settings
from batchd.db.models import Job, JobEvent, JobStatus
from batchd.db.session import session_scope
from batchd.db.types import utcnow
from batchd.jobs.publish import MARK_CHUNK, Publisher
from batchd.queue.broker import BROKER_UNREACHABLE

log = logging.getLogger(__name__)


@dataclass
class RelayReport:
    expired: int = 0
    published: int = 0
    requeued: int = 0  # running jobs whose worker was lost
    lost: int = 0  # ... and failed for good after max_attempts
    republished: int = 0  # queued jobs whose message was lost

    def __bool__(self) -> bool:
        return any(vars(self).values())


def show_relay_logs() -> None:
    """The relay's INFO lines at the default log level (WARNING elsewhere): what it published,
    requeued, republished and expired is what a person reading a worker's log looks for."""
    root = logging.getLogger().getEffectiveLevel()
    log.setLevel(min(root, logging.INFO))


def id_list(ids: Iterable[int], limit: int = 20) -> str:
    """`3-7, 12, 15` for job ids; past `limit` runs, `... (N more)`."""
    ordered = sorted(set(ids))
    runs: list[list[int]] = []
    for job_id in ordered:
        if runs and job_id == runs[-1][1] + 1:
            runs[-1][1] = job_id
        else:
            runs.append([job_id, job_id])
    shown = [str(a) if a == b else f"{a}-{b}" for a, b in runs[:limit]]
    more = sum(b - a + 1 for a, b in runs[limit:])
    return ", ".join(shown) + (f" ... ({more} more)" if more else "")


class Relay:
    def __init__(self, settings: Settings, publisher: Publisher, metrics=None):
        self.settings = settings
        self.publisher = publisher
        self.metrics = metrics   # batchd.metrics.RelayMetrics, or None

    def run_once(self) -> RelayReport:
        report = RelayReport()
        report.expired = self.expire_overdue()
        self.unqueue_unpublished()
        report.published = self.publisher.publish_pending(on_sent=self._log_published)
        report.requeued, report.lost = self.requeue_lost_running()
        if self.publisher.broker_is_marked():
            report.republished = self.republish_lost_queued()
        else:
            report.republished = self.republish_lost_queued(broker_emptied=True)
            self.publisher.mark_broker()
        if self.metrics is not None:
            self.metrics.observe_pass(report)
        return report

    def run_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.run_once()
            except Exception:  # the database or broker is down: say so and keep trying
                if self.metrics is not None:
                    self.metrics.pass_failures.inc()
                log.exception("relay pass failed; retrying in %.0f s", self.settings.relay_interval_s)
            stop.wait(self.settings.relay_interval_s)

    def queue_depths(self) -> dict[str, int]:
        """{queue: messages waiting} for the default model and every model with queued jobs."""
        with session_scope(self.settings.database_url) as session:
            models = set(session.scalars(select(Job.model).where(Job.status == JobStatus.QUEUED).distinct()))
        models = {model or self.settings.model_name for model in models} | {self.settings.model_name}
        return {self.publisher.queue_for(model): self.publisher.queue_length(model) for model in sorted(models)}

    def _log_published(self, sent: list[tuple[int, Optional[str]]]) -> None:
        by_queue: dict[str, list[int]] = defaultdict(list)
        for job_id, model in sent:
            by_queue[self.publisher.queue_for(model)].append(job_id)
        for queue, ids in by_queue.items():
            log.info("relay: published %d pending job(s) to %s: %s", len(ids), queue, id_list(ids))

    def expire_overdue(self) -> int:
        """pending/queued jobs past their deadline -> expired, and the queued ones' messages taken
        out of their queues (as `batchd cancel` does)."""
        now = utcnow()
        waiting = (JobStatus.PENDING, JobStatus.QUEUED)
        with session_scope(self.settings.database_url) as session:
            rows = session.execute(
                select(Job.id, Job.model, Job.status).where(Job.status.in_(waiting), Job.expires_at < now)
                .limit(MARK_CHUNK).with_for_update(skip_locked=True)).all()
            ids = [row.id for row in rows]
            if ids:
                session.execute(update(Job).where(Job.id.in_(ids), Job.status.in_(waiting))
                                .values(status=JobStatus.EXPIRED, expired_at=now, lease_expires_at=None))
                session.execute(insert(JobEvent), [{"job_id": i, "event": "expired", "at": now} for i in ids])
        if ids:
            log.info("relay: expired %d job(s) whose deadline to start passed: %s", len(ids), id_list(ids))
        queued = [(row.id, row.model) for row in rows if row.status == JobStatus.QUEUED]
        if queued:
            try:
                self.publisher.remove_messages(queued)
            except BROKER_UNREACHABLE:   # that costs nothing: a worker that draws one of them drops it
                log.warning("relay: could not remove the messages of %d expired job(s): the broker does not answer",
                            len(queued))
        return len(ids)

    def unqueue_unpublished(self) -> int:
        """`queued` rows without a queue lease -> `pending` (then published by this pass): every
        publisher of batchd sets the lease with the status, so such a row was written by SQL."""
        now = utcnow()
        with session_scope(self.settings.database_url) as session:
            ids = list(session.scalars(
                select(Job.id).where(Job.status == JobStatus.QUEUED, Job.lease_expires_at.is_(None))
                .limit(MARK_CHUNK).with_for_update(skip_locked=True)))
            if ids:
                session.execute(update(Job).where(Job.id.in_(ids), Job.status == JobStatus.QUEUED,
                                                  Job.lease_expires_at.is_(None))
                                .values(status=JobStatus.PENDING, queued_at=None))
                session.execute(insert(JobEvent), [
                    {"job_id": i, "event": "pending", "at": now,
                     "detail": "written as queued without being published (no queue lease): published by the relay"}
                    for i in ids])
        if ids:
            log.info("relay: %d job(s) were queued by SQL without a message; publishing them as pending: %s",
                     len(ids), id_list(ids))
        return len(ids)

    def requeue_lost_running(self) -> tuple[int, int]:
        now = utcnow()
        requeue, lost = [], []
        with session_scope(self.settings.database_url) as session:
            rows = session.execute(
                select(Job.id, Job.model, Job.attempts, Job.worker_id)
                .where(Job.status == JobStatus.RUNNING, Job.lease_expires_at < now)
                .order_by(Job.id).limit(MARK_CHUNK).with_for_update(skip_locked=True)).all()
            for job_id, model, attempts, worker_id in rows:
                (lost if attempts >= self.settings.max_attempts else requeue).append((job_id, model, worker_id))
            if requeue:
                session.execute(
                    update(Job).where(Job.id.in_([r[0] for r in requeue]), Job.status == JobStatus.RUNNING)
                    .values(status=JobStatus.QUEUED, queued_at=now, worker_id=None,
                            lease_expires_at=now + timedelta(seconds=self.settings.queue_lease_s)))
                session.execute(insert(JobEvent), [
                    {"job_id": i, "event": "requeued", "at": now, "worker_id": w,
                     "detail": "the worker's lease expired (worker killed or lost)"} for i, _, w in requeue])
            if lost:
                message = (f"the worker running this job was lost {self.settings.max_attempts} times (killed, out of "
                           "memory, or past the hard time limit); `batchd retry` runs it again")
                session.execute(
                    update(Job).where(Job.id.in_([r[0] for r in lost]), Job.status == JobStatus.RUNNING)
                    .values(status=JobStatus.FAILED, failed_at=now, lease_expires_at=None, error_kind="worker_lost",
                            error_message=message, retryable=True))
                session.execute(insert(JobEvent), [
                    {"job_id": i, "event": "failed", "at": now, "worker_id": w, "detail": f"worker_lost: {message}"}
                    for i, _, w in lost])
        self.publisher.send([(job_id, model) for job_id, model, _ in requeue])
        by_worker: dict[str, list[int]] = defaultdict(list)
        for job_id, _, worker_id in requeue:
            by_worker[worker_id or "?"].append(job_id)
        for worker_id, ids in by_worker.items():
            log.info("relay: requeued %d running job(s) of worker %s, whose lease expired: %s", len(ids), worker_id,
                     id_list(ids))
        if lost:
            log.warning("relay: failed %d job(s) as worker_lost (their worker was lost %d times): %s", len(lost),
                        self.settings.max_attempts, id_list(i for i, _, _ in lost))
        return len(requeue), len(lost)

    def republish_lost_queued(self, broker_emptied: bool = False) -> int:
        """Send again, per model, as many of the oldest queued jobs as its queue lacks messages.
        Only jobs whose queue lease expired, unless the broker lost its data (then any)."""
        now = utcnow()
        overdue = Job.status == JobStatus.QUEUED
        if not broker_emptied:
            overdue &= Job.lease_expires_at < now
        why = ("the broker lost its messages (it restarted empty or was flushed)" if broker_emptied
               else "queue lease expired and the queue holds fewer messages than queued jobs")
        with session_scope(self.settings.database_url) as session:
            overdue_models = session.scalars(select(Job.model).where(overdue).distinct()).all()
        return sum(self._republish_missing(model, overdue, why, now) for model in overdue_models)

    def _republish_missing(self, model: Optional[str], overdue, why: str, now) -> int:
        """Chunk by chunk, oldest first: as many `overdue` jobs of the model as its queue lacks."""
        sent, after_id = 0, 0
        while True:
            with session_scope(self.settings.database_url) as session:
                queued = session.scalar(select(func.count()).where(Job.status == JobStatus.QUEUED, Job.model == model))
            deficit = queued - self.publisher.queue_length(model)
            if deficit <= 0:
                return sent
            with session_scope(self.settings.database_url) as session:
                ids = list(session.scalars(
                    select(Job.id).where(overdue, Job.model == model, Job.id > after_id)
                    .order_by(Job.id).limit(min(deficit, MARK_CHUNK)).with_for_update(skip_locked=True)))
                if not ids:
                    return sent
                session.execute(update(Job).where(Job.id.in_(ids), Job.status == JobStatus.QUEUED)
                                .values(lease_expires_at=now + timedelta(seconds=self.settings.queue_lease_s)))
                session.execute(insert(JobEvent), [{"job_id": i, "event": "republished", "at": now, "detail": why}
                                                   for i in ids])
            self.publisher.send([(i, model) for i in ids])
            log.info("relay: republished %d queued job(s) to %s (%s): %s", len(ids),
                     self.publisher.queue_for(model), why, id_list(ids))
            sent, after_id = sent + len(ids), ids[-1]


def start_relay_thread(relay: Relay) -> tuple[threading.Thread, threading.Event]:
    stop = threading.Event()
    thread = threading.Thread(target=relay.run_forever, args=(stop,), name="batchd-relay", daemon=True)
    thread.start()
    return thread, stop
