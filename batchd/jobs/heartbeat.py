"""Worker heartbeats and the jobs no worker serves.

Each worker process keeps a row of `workers` (its id, model and host) and refreshes its
`last_seen_at` from its lease keeper. A model is served while one of its workers was seen
within `unserved_after_s`; jobs of a model that nobody has served for that long, and that have
waited that long themselves, are what `batchd status` reports (they would otherwise wait with
no word until their batch's `--expires-in`, or for ever).
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Optional

from sqlalchemy import delete, func, insert, select, update

from batchd.db.models import Job, JobStatus, Worker
from batchd.db.session import read_scope, session_scope
from batchd.db.types import utcnow
from batchd.jobs.progress import _aware

FORGET_AFTER = timedelta(days=7)   # rows of workers gone this long are deleted when a worker starts
WAITING = (JobStatus.PENDING, JobStatus.QUEUED)


def register_worker(url: str, worker_id: str, model: str) -> None:
    """The worker's row, and the rows of workers long gone pruned (one per process ever run)."""
    now = utcnow()
    with session_scope(url) as session:
        session.execute(delete(Worker).where(Worker.last_seen_at < now - FORGET_AFTER))
        session.execute(insert(Worker).values(worker_id=worker_id, model=model, host=socket.gethostname(),
                                              started_at=now, last_seen_at=now))


def beat(url: str, worker_id: str) -> None:
    with session_scope(url) as session:
        session.execute(update(Worker).where(Worker.worker_id == worker_id).values(last_seen_at=utcnow()))


@dataclass(frozen=True)
class UnservedModel:
    model: str
    waiting: int                         # jobs of the batch waiting for it past the threshold
    last_seen_at: Optional[datetime]     # the last heartbeat of any of its workers; None: never one
    expires_at: Optional[datetime]       # the latest deadline among those jobs; None: some have none

    def line(self) -> str:
        jobs = f"{self.waiting} job{'s' if self.waiting != 1 else ''}"
        seen = (f"its last worker was seen {self.last_seen_at:%Y-%m-%d %H:%M} UTC" if self.last_seen_at
                else "no worker has served it")
        ends = (f"they expire by {self.expires_at:%Y-%m-%d %H:%M} UTC" if self.expires_at
                else "they have no deadline (submit with --expires-in)")
        return (f"{jobs} wait for model {self.model}, which no worker serves ({seen}; {ends}): start a "
                f"worker with `--model-name {self.model}`, or `batchd cancel` them")


def unserved_models(url: str, batch_id: int, default_model: str, unserved_after_s: float) -> list[UnservedModel]:
    """The models the batch's waiting jobs name that no worker has served for `unserved_after_s`,
    counting the jobs that have waited at least that long."""
    since = utcnow() - timedelta(seconds=unserved_after_s)
    model = func.coalesce(Job.model, default_model)   # a pending row without a model gets the relay's default
    with read_scope(url) as session:
        waiting = session.execute(   # pending_at: when it was submitted, or retried
            select(model, func.count(), func.count(Job.expires_at), func.max(Job.expires_at))
            .where(Job.batch_id == batch_id, Job.status.in_(WAITING), Job.pending_at < since)
            .group_by(model)).all()
        if not waiting:
            return []
        seen = dict(session.execute(select(Worker.model, func.max(Worker.last_seen_at))
                                    .where(Worker.model.in_([row[0] for row in waiting]))
                                    .group_by(Worker.model)).all())
    unserved = []
    for name, count, with_deadline, latest_deadline in sorted(waiting):
        last = _aware(seen.get(name))
        if last is not None and last >= since:
            continue
        expires_at = _aware(latest_deadline) if with_deadline == count else None
        unserved.append(UnservedModel(name, int(count), last, expires_at))
    return unserved
