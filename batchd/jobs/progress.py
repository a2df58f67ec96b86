"""A batch's progress: counts per status, throughput and an ETA."""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Optional

from sqlalchemy import func, select

from batchd.db.models import Batch, FINISHED, Job, JobStatus, Result
from batchd.db.session import read_scope
from batchd.db.types import utcnow


class UnknownBatch(LookupError):
    pass


@dataclass
class BatchProgress:
    name: str
    batch_id: int
    created_at: datetime
    counts: dict[str, int] = field(default_factory=dict)
    first_started_at: Optional[datetime] = None
    last_finished_at: Optional[datetime] = None
    generated_tokens: int = 0
    prompt_tokens: int = 0
    worked: int = 0  # finished jobs a worker ran (not those refused at submit)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def finished(self) -> int:
        return sum(self.counts.get(s.value, 0) for s in FINISHED)

    @property
    def done(self) -> bool:
        return self.finished == self.total

    @property
    def elapsed_s(self) -> float:
        if self.first_started_at is None:
            return 0.0
        end = self.last_finished_at if self.done and self.last_finished_at else utcnow()
        return max((end - self.first_started_at).total_seconds(), 1e-9)

    @property
    def jobs_per_s(self) -> float:
        return self.worked / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> Optional[float]:
        remaining = self.total - self.finished
        if remaining == 0:
            return 0.0
        return remaining / self.jobs_per_s if self.jobs_per_s > 0 else None


def batch_progress(url: str, name: str) -> BatchProgress:
    with read_scope(url) as session:
        batch = session.scalar(select(Batch).where(Batch.name == name))
        if batch is None:
            raise UnknownBatch(f"no batch named {name!r}; `batchd status` lists them")
        return _progress(session, batch)


def all_batches(url: str) -> list[BatchProgress]:
    with read_scope(url) as session:
        return [_progress(session, b) for b in session.scalars(select(Batch).order_by(Batch.id))]


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: str
    in_flight: int                 # jobs running under this worker now
    batches: int                   # how many batches they come from


def workers_in_flight(url: str) -> list[WorkerLoad]:
    """Each worker holding running jobs, with how many (a batched worker holds many at once)."""
    with read_scope(url) as session:
        rows = session.execute(select(Job.worker_id, func.count(), func.count(func.distinct(Job.batch_id)))
                               .where(Job.status == JobStatus.RUNNING, Job.worker_id.is_not(None))
                               .group_by(Job.worker_id).order_by(Job.worker_id)).all()
    return [WorkerLoad(worker, int(n), int(batches)) for worker, n, batches in rows]


def _progress(session, batch: Batch) -> BatchProgress:
    progress = BatchProgress(name=batch.name, batch_id=batch.id, created_at=batch.created_at)
    for status, count in session.execute(select(Job.status, func.count()).where(Job.batch_id == batch.id)
                                         .group_by(Job.status)):
        progress.counts[JobStatus(status).value] = count
    first, last, worked = session.execute(
        select(func.min(Job.running_at), func.max(func.coalesce(Job.succeeded_at, Job.failed_at)),
               func.count(Job.running_at).filter(Job.status.in_((JobStatus.SUCCEEDED, JobStatus.FAILED))))
        .where(Job.batch_id == batch.id)).one()
    progress.first_started_at, progress.last_finished_at = _aware(first), _aware(last)
    progress.worked = int(worked)
    tokens = session.execute(select(func.coalesce(func.sum(Result.generated_tokens), 0),
                                    func.coalesce(func.sum(Result.prompt_tokens), 0))
                             .join(Job, Job.id == Result.job_id).where(Job.batch_id == batch.id)).one()
    progress.generated_tokens, progress.prompt_tokens = int(tokens[0]), int(tokens[1])
    return progress


def _aware(value):
    """min()/max() over a UTC column come back as plain values on SQLite: restore the type's UTC."""
    from batchd.db.types import UTCDateTime

    if value is None or isinstance(value, datetime) and value.tzinfo is not None:
        return value
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return UTCDateTime().process_result_value(value, None)
