"""Run one job on the worker's resident engine: claim, generate, persist.

    claim (CAS queued -> running)  ->  build the request  ->  engine.generate
        ->  result + succeeded in one transaction       (or failed with kind and message)

An `EngineError` fails the job at once with its kind, message and retryable flag; any other
exception from the engine is a bug: it is logged with its traceback and the job fails as
`internal`, and the worker goes on with the next job. Database or broker trouble is
transient: the claim is released and the task retried with backoff.
"""
from __future__ import annotations

import dataclasses
import logging
import signal
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Optional

from sqlalchemy.exc import DBAPIError, OperationalError

from batchd.config import Settings
from batchd.db.types import utcnow
from batchd.jobs import lifecycle
from batchd.jobs.params import build_request
from batchd.engine.errors import EngineError
from batchd.engine.types import GenerationResult, Telemetry

log = logging.getLogger(__name__)

TELEMETRY_FIELDS = tuple(f.name for f in dataclasses.fields(Telemetry))
FINGERPRINT_COLUMNS = ("target_sha256", "drafter_sha256", "drafter_path", "dtype", "kv_dtype", "temperature",
                       "top_k", "top_p", "seed", "max_new_tokens", "spec_width", "keep_ratio")


class TransientJobError(Exception):
    """The database or broker failed under the job: retry the task later."""


class JobTimeLimitExceeded(Exception):
    pass


@dataclass
class RunningJob:
    job_id: int
    started_monotonic: float


class JobRunner:
    """Holds the engine and this worker's identity; `run(job_id)` is the Celery task's body."""

    def __init__(self, settings: Settings, engine, worker_id: str):
        self.settings = settings
        self.engine = engine
        self.worker_id = worker_id
        self.host = socket.gethostname()
        self.current: Optional[RunningJob] = None  # read by the lease keeper thread

    def run(self, job_id: int) -> str:
        """Process one delivery of `job_id`; returns what happened (for logs and tests)."""
        url = self.settings.database_url
        try:
            job = lifecycle.claim(url, job_id, self.worker_id, self.settings.lease_s)
            if job is None:
                status = lifecycle.ignored_delivery(url, job_id, self.worker_id)
                log.info("job %s: delivery ignored (status %s)", job_id, status)
                return "ignored"
        except (OperationalError, DBAPIError) as exc:
            raise TransientJobError(f"database unavailable while claiming job {job_id}: {exc}") from exc
        self.current = RunningJob(job_id, time.monotonic())
        try:
            return self._run_claimed(job)
        except (OperationalError, DBAPIError) as exc:
            self._release(job_id, f"database error: {type(exc).__name__}")
            raise TransientJobError(f"database unavailable while running job {job_id}: {exc}") from exc
        finally:
            self.current = None

    def _run_claimed(self, job) -> str:
        url, job_id = self.settings.database_url, job.id
        started_at = utcnow()
        try:
            request = build_request(job.prompt, job.messages, job.params)
            with time_limit(self.settings.soft_time_limit_s):
                generated = self.engine.generate(request)
        except EngineError as exc:
            lifecycle.fail(url, job_id, self.worker_id, exc.kind, exc.message, exc.retryable)
            log.info("job %s failed: %s: %s", job_id, exc.kind, exc.message)
            return "failed"
        except JobTimeLimitExceeded:
            message = (f"the job ran past its {self.settings.soft_time_limit_s:.0f} s limit: lower max_new_tokens, "
                       "or raise BATCHD_JOB_TIME_LIMIT_S")
            lifecycle.fail(url, job_id, self.worker_id, "timeout", message, True)
            return "failed"
        except (OperationalError, DBAPIError):
            raise
        except Exception as exc:  # a bug: keep the traceback in the log, fail this job, keep the worker
            log.exception("job %s: internal error", job_id)
            lifecycle.fail(url, job_id, self.worker_id, "internal",
                           f"{type(exc).__name__}: {exc} (a bug; the worker log has the traceback)", False)
            return "failed"
        finished_at = utcnow()
        row = result_row(generated, queue_wait_s=_seconds_between(job.queued_at, job.running_at),
                         worker_host=self.host, worker_id=self.worker_id, started_at=started_at,
                         finished_at=finished_at)
        if not lifecycle.complete(url, job_id, self.worker_id, row):
            lifecycle.add_event(url, job_id, "result_discarded", self.worker_id,
                                       "the job was cancelled or taken over while it ran")
            log.warning("job %s: no longer ours (cancelled or lease taken over); result discarded", job_id)
            return "discarded"
        return "succeeded"

    def _release(self, job_id: int, reason: str) -> None:
        try:
            lifecycle.release(self.settings.database_url, job_id, self.worker_id, reason, self.settings.queue_lease_s)
        except (OperationalError, DBAPIError):
            log.warning("job %s: could not release it; the relay requeues it when its lease expires", job_id)


def result_row(generated: GenerationResult, *, queue_wait_s: Optional[float], worker_host: str, worker_id: str,
               started_at: datetime, finished_at: datetime) -> dict[str, Any]:
    """The `results` row: output, token counts, fingerprint columns and every telemetry field."""
    telemetry = generated.telemetry
    fingerprint = dict(generated.fingerprint or {})
    row: dict[str, Any] = {name: getattr(telemetry, name) for name in TELEMETRY_FIELDS}
    row.update({name: fingerprint.get(name) for name in FINGERPRINT_COLUMNS})
    row.update(
        output_text=generated.text,
        output_sha256=generated.output_sha256,
        token_ids_sha256=generated.token_ids_sha256,
        prompt_tokens=generated.prompt_tokens,
        effective_prompt_tokens=generated.effective_prompt_tokens,
        generated_tokens=generated.generated_tokens,
        finish_reason=generated.finish_reason,
        compress_mode=fingerprint.get("compress"),
        compression_ratio=(generated.effective_prompt_tokens / generated.prompt_tokens
                           if generated.prompt_tokens else None),
        fingerprint=fingerprint,
        queue_wait_s=queue_wait_s,
        worker_host=worker_host,
        worker_id=worker_id,
        engine_started_at=started_at,
        engine_finished_at=finished_at,
    )
    return row


def _seconds_between(start: Optional[datetime], end: Optional[datetime]) -> Optional[float]:
    return (end - start).total_seconds() if start and end else None


@contextmanager
def time_limit(seconds: float):
    """Raise JobTimeLimitExceeded in the job after `seconds` (the solo pool runs tasks in the
    main thread, where SIGALRM is delivered; Celery's own limits need prefork)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return

    def on_alarm(_signum, _frame):
        raise JobTimeLimitExceeded(seconds)

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_current_runner: Optional[JobRunner] = None


def set_current_runner(runner: Optional[JobRunner]) -> None:
    global _current_runner
    _current_runner = runner


def current_runner() -> JobRunner:
    if _current_runner is None:
        raise RuntimeError("no JobRunner in this process: tasks run inside `batchd worker`")
    return _current_runner
