"""Move pending jobs onto their model's queue: mark them queued, commit, then send their ids.

Marking first means a worker never receives a message for a job that is still pending. If
sending fails, the jobs go back to pending for the relay to try again; a message lost after
a successful send is what the relay's queue lease is for. Messages carry the job id only.
Sending is pipelined (one Redis round trip per `SEND_BATCH` messages).
"""
from __future__ import annotations

import json
import logging
from collections import defaultdict
from datetime import timedelta
from typing import Callable, Optional, Sequence

from kombu.common import maybe_declare
from kombu.utils.uuid import uuid
from sqlalchemy import String, bindparam, select, update
from sqlalchemy.sql import func

from batchd.config import Settings, queue_name
from batchd.db.models import Job, JobStatus
from batchd.db.session import session_scope
from batchd.db.types import utcnow
from batchd.jobs.lifecycle import JOBS, LEASE_UNTIL, NOW, Transition

log = logging.getLogger(__name__)

TASK_NAME = "batchd.run_job"
SEND_BATCH = 1000
MARK_CHUNK = 1000


def _mark_queued(only_given_ids: bool) -> Transition:
    """The UPDATE ... RETURNING that marks pending jobs queued. Rows are taken with SKIP LOCKED,
    so relays on PostgreSQL share the work; a job without a model gets the default one."""
    pending = JOBS.alias("pending")
    oldest = select(pending.c.id).where(pending.c.status == JobStatus.PENDING)
    if only_given_ids:
        oldest = oldest.where(pending.c.id.in_(bindparam("ids", expanding=True)))
    oldest = oldest.order_by(pending.c.id).limit(MARK_CHUNK).with_for_update(skip_locked=True)
    return Transition("queued", cas=(
        update(JOBS).where(JOBS.c.id.in_(oldest), JOBS.c.status == JobStatus.PENDING)
        .values(status=JobStatus.QUEUED, queued_at=NOW, lease_expires_at=LEASE_UNTIL,
                model=func.coalesce(JOBS.c.model, bindparam("default_model", type_=String)))
        .returning(JOBS.c.id, JOBS.c.model)))


MARK_OLDEST_QUEUED, MARK_THESE_QUEUED = _mark_queued(False), _mark_queued(True)


class Publisher:
    def __init__(self, settings: Settings, app):
        self.settings = settings
        self.app = app  # a configured Celery app (batchd.queue.celery_app)

    def queue_for(self, model: Optional[str]) -> str:
        return queue_name(self.settings.queue_prefix, model or self.settings.model_name)

    def send(self, jobs: Sequence[tuple[int, Optional[str]]]) -> None:
        """Publish (job id, model) pairs, each to its model's queue: the task messages Celery's
        `send_task` builds, with each queue declared once per call (not once per message) and
        the Redis commands pipelined. A failure raises; the caller puts the jobs back."""
        if not jobs:
            return
        by_queue: dict[str, list[int]] = defaultdict(list)
        for job_id, model in jobs:
            by_queue[self.queue_for(model)].append(job_id)
        amqp = self.app.amqp
        with self.app.producer_or_acquire() as producer, producer.batch(SEND_BATCH):
            for name, job_ids in by_queue.items():
                queue = amqp.queues[name]  # created on first use (task_create_missing_queues)
                maybe_declare(queue, producer.channel)
                for job_id in job_ids:
                    message = amqp.create_task_message(uuid(), TASK_NAME, [job_id], {}, argsrepr=f"[{job_id}]",
                                                       kwargsrepr="{}")
                    amqp.send_task_message(producer, TASK_NAME, message, queue=queue, declare=[], retry=False)

    def publish_pending(self, job_ids: Optional[Sequence[int]] = None, limit: int = 10_000, *,
                        on_sent: Optional[Callable[[list[tuple[int, str]]], None]] = None) -> int:
        """pending -> queued for these jobs (or the oldest `limit`), then send; how many were sent.
        `on_sent` hears each chunk's (job id, model) pairs once they are sent (the relay logs them)."""
        sent = 0
        chunks = ([list(job_ids[i:i + MARK_CHUNK]) for i in range(0, len(job_ids), MARK_CHUNK)]
                  if job_ids is not None else [None] * max(1, limit // MARK_CHUNK))
        for chunk in chunks:
            marked = self.mark_queued(chunk)
            if not marked:
                if chunk is None:
                    break  # no pending jobs left
                continue
            try:
                self.send(marked)
            except Exception:
                self.unmark([job_id for job_id, _ in marked])
                raise
            sent += len(marked)
            if on_sent is not None:
                on_sent(marked)
        return sent

    def mark_queued(self, job_ids: Optional[list[int]]) -> list[tuple[int, str]]:
        """pending -> queued for the oldest `MARK_CHUNK` pending jobs (or those of `job_ids`);
        their (id, model), oldest first. One statement on PostgreSQL (see batchd.jobs.lifecycle)."""
        now = utcnow()
        params = {"now": now, "lease_until": now + timedelta(seconds=self.settings.queue_lease_s),
                  "default_model": self.settings.model_name}
        if job_ids is None:
            marked = MARK_OLDEST_QUEUED.run(self.settings.database_url, params)
        else:
            marked = MARK_THESE_QUEUED.run(self.settings.database_url, {**params, "ids": job_ids})
        return sorted((job.id, job.model) for job in marked)

    def unmark(self, job_ids: list[int]) -> None:
        with session_scope(self.settings.database_url) as session:
            session.execute(update(Job).where(Job.id.in_(job_ids), Job.status == JobStatus.QUEUED,
                                              Job.worker_id.is_(None))
                            .values(status=JobStatus.PENDING, queued_at=None, lease_expires_at=None))
        log.warning("publishing %d jobs failed; they are pending again for the relay", len(job_ids))

    def queue_length(self, model: str) -> int:
        """Messages waiting in a model's Redis list (not counting ones a worker holds unacked)."""
        with self.app.connection_for_write() as connection:
            return int(connection.default_channel.client.llen(self.queue_for(model)))

    @property
    def broker_mark_key(self) -> str:
        return f"{self.settings.queue_prefix}.broker-mark"

    def broker_is_marked(self) -> bool:
        """Whether the mark the relay leaves in the broker is there. A broker that restarted empty
        (no persistence) or was flushed lost it together with every message it held."""
        with self.app.connection_for_write() as connection:
            return bool(connection.default_channel.client.exists(self.broker_mark_key))

    def mark_broker(self) -> None:
        with self.app.connection_for_write() as connection:
            connection.default_channel.client.set(self.broker_mark_key, utcnow().isoformat())

    def remove_messages(self, jobs: Sequence[tuple[int, Optional[str]]]) -> int:
        """Take these jobs' waiting messages out of their models' queues (a cancelled or deleted
        job's message would otherwise wait there until a worker drew it only to drop it); how many
        were removed. A message a worker already holds is not in the list: its claim finds the job
        finished and acknowledges it."""
        by_queue: dict[str, set[int]] = defaultdict(set)
        for job_id, model in jobs:
            by_queue[self.queue_for(model)].add(job_id)
        removed = 0
        with self.app.connection_for_write() as connection:
            client = connection.default_channel.client
            for queue, job_ids in by_queue.items():
                removed += _remove_from_list(client, queue, job_ids)
        return removed


def _remove_from_list(client, queue: str, job_ids: set[int]) -> int:
    """LREM each message of `job_ids` from a kombu Redis list, read a chunk at a time. Workers pop
    from the other end and publishers push at the head (which only makes a chunk be read twice),
    so a concurrent consumer neither blocks this nor loses a message to it."""
    removed, start = 0, 0
    while True:
        chunk = client.lrange(queue, start, start + SEND_BATCH - 1)
        if not chunk:
            return removed
        doomed = [raw for raw in chunk if message_job_id(raw) in job_ids]
        if doomed:
            pipeline = client.pipeline(transaction=False)
            for raw in doomed:
                pipeline.lrem(queue, 1, raw)
            gone = sum(pipeline.execute())
            removed += gone
        else:
            gone = 0
        start += len(chunk) - gone


def message_job_id(raw: bytes) -> Optional[int]:
    """The job id a task message of ours carries (its `argsrepr` header, `[17]`), else None."""
    try:
        argsrepr = json.loads(raw)["headers"]["argsrepr"]
        return int(argsrepr.strip("[](), "))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
