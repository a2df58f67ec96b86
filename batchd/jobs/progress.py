"""A batch's progress and totals: counts per status, its real span, throughput and an ETA.

Two spans, read from the record rather than from the jobs' current columns (a retry or a
requeue rewrites `running_at`; the append-only `job_events` keep the first claim):
- the wall span, from the batch's first submit to its last finished job (to now while it
  runs): what a person waited, and what its documents/hour are measured over;
- the busy span, from the first time a worker claimed one of its jobs: what the workers'
  throughput is measured over.

The ETA comes from measured token throughput: the tokens the workers got through (prompt as
the model saw it, after compression, plus generated) per second of the busy span, against the
tokens the unfinished jobs still hold. Those are estimated from their input's length in
characters, at the tokens per character of the jobs already done, plus the mean generated
length so far; a batch whose long documents come last gets a longer ETA than one of equal
jobs, where counting jobs alone would give both the same.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Optional

from sqlalchemy import Text, case, cast, func, select

from batchd.db.models import Batch, FINISHED, Job, JobEvent, JobStatus, Result, UNFINISHED
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
    submitted_at: Optional[datetime] = None      # the first job's submit
    first_started_at: Optional[datetime] = None  # the first claim of any of its jobs (job_events)
    last_finished_at: Optional[datetime] = None  # the last job to reach a finished state
    worked: int = 0  # finished jobs a worker ran (not those refused at submit)
    prompt_tokens: int = 0               # of the succeeded jobs, as submitted
    effective_prompt_tokens: int = 0     # ... as the model saw them (after compression)
    generated_tokens: int = 0
    done_input_chars: int = 0            # input length of the succeeded jobs, in characters
    remaining_input_chars: int = 0       # ... of the jobs not finished yet
    now: datetime = field(default_factory=utcnow)  # when this was read: the end of a live span

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def finished(self) -> int:
        return sum(self.counts.get(s.value, 0) for s in FINISHED)

    @property
    def succeeded(self) -> int:
        return self.counts.get(JobStatus.SUCCEEDED.value, 0)

    @property
    def remaining(self) -> int:
        return self.total - self.finished

    @property
    def done(self) -> bool:
        return self.finished == self.total

    @property
    def _end(self) -> datetime:
        return self.last_finished_at if self.done and self.last_finished_at else self.now

    @property
    def wall_s(self) -> float:
        """First submit to the last finished job (to now while jobs remain)."""
        if self.submitted_at is None:
            return 0.0
        return max((self._end - self.submitted_at).total_seconds(), 0.0)

    @property
    def busy_s(self) -> float:
        """The first claim by a worker to the last finished job (to now while jobs remain)."""
        if self.first_started_at is None:
            return 0.0
        return max((self._end - self.first_started_at).total_seconds(), 0.0)

    @property
    def jobs_per_s(self) -> float:
        """Jobs finished by workers per second of the wall span once done, of the busy span before."""
        span = self.wall_s if self.done else self.busy_s
        return self.worked / span if span > 0 else 0.0

    @property
    def documents_per_hour(self) -> float:
        """Succeeded jobs per hour of the wall span: what an overnight run is judged by."""
        return self.succeeded * 3600 / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of the busy span."""
        return self.generated_tokens / self.busy_s if self.busy_s > 0 else 0.0

    @property
    def work_tokens_per_s(self) -> float:
        """Prompt (after compression) plus generated tokens per second of the busy span."""
        return (self.effective_prompt_tokens + self.generated_tokens) / self.busy_s if self.busy_s > 0 else 0.0

    @property
    def remaining_tokens(self) -> Optional[float]:
        """The tokens the unfinished jobs hold, estimated from the jobs done (None: none done yet)."""
        if self.remaining == 0:
            return 0.0
        if self.succeeded == 0 or self.done_input_chars == 0:
            return None
        prompt_per_char = self.effective_prompt_tokens / self.done_input_chars
        return self.remaining_input_chars * prompt_per_char + self.remaining * self.generated_tokens / self.succeeded

    @property
    def eta_s(self) -> Optional[float]:
        """Seconds until the last job finishes at the measured token throughput (None: not measured yet)."""
        remaining = self.remaining_tokens
        if remaining is None or self.work_tokens_per_s <= 0:
            return None if self.remaining else 0.0
        return remaining / self.work_tokens_per_s


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


# a job's input length in characters: its prompt, or its messages as JSON text
INPUT_CHARS = func.coalesce(func.length(Job.prompt), func.length(cast(Job.messages, Text)), 0)
FINISHED_AT = func.coalesce(Job.succeeded_at, Job.failed_at, Job.cancelled_at, Job.expired_at)


def _progress(session, batch: Batch) -> BatchProgress:
    progress = BatchProgress(name=batch.name, batch_id=batch.id, created_at=batch.created_at)
    of_batch = Job.batch_id == batch.id
    for status, count in session.execute(select(Job.status, func.count()).where(of_batch).group_by(Job.status)):
        progress.counts[JobStatus(status).value] = count
    submitted, last, worked, remaining_chars = session.execute(
        select(func.min(Job.created_at), func.max(FINISHED_AT).filter(Job.status.in_(FINISHED)),
               func.count(Job.running_at).filter(Job.status.in_((JobStatus.SUCCEEDED, JobStatus.FAILED))),
               func.coalesce(func.sum(case((Job.status.in_(UNFINISHED), INPUT_CHARS), else_=0)), 0))
        .where(of_batch)).one()
    first_claim = session.scalar(select(func.min(JobEvent.at)).join(Job, Job.id == JobEvent.job_id)
                                 .where(of_batch, JobEvent.event == "running"))
    progress.submitted_at, progress.last_finished_at = _aware(submitted), _aware(last)
    progress.first_started_at = _aware(first_claim)
    progress.worked, progress.remaining_input_chars = int(worked), int(remaining_chars)
    tokens = session.execute(select(func.coalesce(func.sum(Result.prompt_tokens), 0),
                                    func.coalesce(func.sum(Result.effective_prompt_tokens), 0),
                                    func.coalesce(func.sum(Result.generated_tokens), 0),
                                    func.coalesce(func.sum(INPUT_CHARS), 0))
                             .join(Job, Job.id == Result.job_id).where(of_batch)).one()
    (progress.prompt_tokens, progress.effective_prompt_tokens, progress.generated_tokens,
     progress.done_input_chars) = (int(value) for value in tokens)
    progress.now = utcnow()
    return progress


def _aware(value):
    """min()/max() over a UTC column come back as plain values on SQLite: restore the type's UTC."""
    from batchd.db.types import UTCDateTime

    if value is None or isinstance(value, datetime) and value.tzinfo is not None:
        return value
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return UTCDateTime().process_result_value(value, None)
