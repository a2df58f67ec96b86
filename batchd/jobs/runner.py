"""Run one job on the worker's batch: claim, hand it to the engine loop, persist.

    claim (CAS queued -> running)  ->  build the request  ->  engine loop (joins the batch)
        ->  result + succeeded in one transaction       (or failed with kind and message)

Each Celery task thread runs `JobRunner.run(job_id)` for one job and waits for the engine loop
(batchd.jobs.engine_loop) to finish it beside the other jobs in flight. An `EngineError` fails
the job at once with its kind, message and retryable flag; a bug inside the engine fails the
job as `internal`, and the worker goes on. Past the soft time limit the job is taken out of the
batch and fails as `timeout`. Database or broker trouble is transient: a finished result is
kept and its commit retried for up to `COMMIT_PATIENCE_S`; otherwise the claim is released
and the task retried with backoff. A job the loop hands back (out of memory, shutdown) is
released to the queue and retried. batchd.jobs.settle bounds both: a permanent error (a
value its column cannot hold, a bug) fails the job at once, and the `max_attempts`-th
delivery that ends transiently fails it for good.
"""
from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Optional

from sqlalchemy.exc import DBAPIError, OperationalError

from batchd.config import Settings
from batchd.db.types import utcnow
from batchd.db.errors import is_transient, one_line
from batchd.jobs import lifecycle, settle
from batchd.jobs.job_request import request_for_job
from batchd.engine.errors import EngineError
from batchd.engine.types import GenerationResult, Telemetry

log = logging.getLogger(__name__)

TELEMETRY_FIELDS = tuple(f.name for f in dataclasses.fields(Telemetry))
FINGERPRINT_COLUMNS = ("target_sha256", "drafter_sha256", "drafter_path", "dtype", "kv_dtype", "temperature",
                       "top_k", "top_p", "seed", "max_new_tokens", "spec_width", "keep_ratio", "decode_mlp")
COMMIT_PATIENCE_S = 120.0   # how long a finished result waits for the database before it is given up


class TransientJobError(Exception):
    """The database or broker failed under the job, or the batch handed it back: retry later."""


@dataclass
class RunningJob:
    job_id: int
    started_monotonic: float


class JobRunner:
    """This worker's identity, its engine loop (`jobs`: submit/cancel, batchd.jobs.engine_loop)
    and the jobs it holds; `run(job_id)` is the Celery task's body, called from many threads."""

    def __init__(self, settings: Settings, jobs, worker_id: str):
        self.settings = settings
        self.jobs = jobs
        self.worker_id = worker_id
        self.host = socket.gethostname()
        self._lock = threading.Lock()
        self._in_flight: dict[int, RunningJob] = {}  # read by the lease keeper thread

    def in_flight(self) -> list[RunningJob]:
        with self._lock:
            return list(self._in_flight.values())

    def run(self, job_id: int) -> str:
        """Process one delivery of `job_id`; returns what happened (for logs and tests)."""
        url = self.settings.database_url
        try:
            job = lifecycle.claim(url, job_id, self.worker_id, self.settings.lease_s)
            if job is None:
                status = lifecycle.ignored_delivery(url, job_id, self.worker_id)
                log.info("job %s: delivery ignored (status %s)", job_id, status)
                return "ignored"
        except Exception as exc:
            if not is_transient(exc):   # the row itself: fail it rather than meet this on every delivery
                return "failed" if settle.fail_unclaimable(self.settings, job_id, exc) else "ignored"
            raise TransientJobError(f"database unavailable while claiming job {job_id}: {one_line(exc)}") from exc
        with self._lock:
            self._in_flight[job_id] = RunningJob(job_id, time.monotonic())
        try:
            return self._run_claimed(job)
        except TransientJobError:
            raise
        except Exception as exc:   # batchd.jobs.settle: back to the queue, or failed for good
            if settle.settle_exception(self.settings, job_id, self.worker_id, job.attempts, exc):
                raise TransientJobError(f"job {job_id}: {one_line(exc)}") from exc
            return "failed"
        finally:
            with self._lock:
                self._in_flight.pop(job_id, None)

    def _run_claimed(self, job) -> str:
        url, job_id = self.settings.database_url, job.id
        started_at = utcnow()
        try:
            request = request_for_job(self.settings, job)
        except EngineError as exc:
            return self._fail(job_id, exc)
        outcome = self._wait(job_id, self.jobs.submit(job_id, request))
        if outcome.error is not None:
            return self._fail(job_id, outcome.error)
        if outcome.cancelled == "timeout":
            message = (f"the job ran past its {self.settings.soft_time_limit_s:.0f} s limit: lower max_new_tokens, "
                       "or raise BATCHD_JOB_TIME_LIMIT_S")
            lifecycle.fail(url, job_id, self.worker_id, "timeout", message, True)
            return "failed"
        if outcome.cancelled is not None:
            log.info("job %s left the batch: %s", job_id, outcome.cancelled)
            return "cancelled"
        if outcome.requeue is not None:
            if not settle.hand_back(self.settings, job_id, self.worker_id, job.attempts, outcome.requeue):
                return "failed"
            raise TransientJobError(f"job {job_id} handed back by the batch: {outcome.requeue}")
        row = result_row(outcome.result, queue_wait_s=_seconds_between(job.queued_at, job.running_at),
                         worker_host=self.host, worker_id=self.worker_id, started_at=started_at,
                         finished_at=utcnow())
        if not self._commit(job_id, row):
            lifecycle.add_event(url, job_id, "result_discarded", self.worker_id,
                                "the job was cancelled or taken over while it ran")
            log.warning("job %s: no longer ours (cancelled or lease taken over); result discarded", job_id)
            return "discarded"
        return "succeeded"

    def _wait(self, job_id: int, future):
        """The loop's outcome for the job; past the soft time limit, the job is cancelled."""
        try:
            return future.result(timeout=self.settings.soft_time_limit_s)
        except FutureTimeout:
            self.jobs.cancel(job_id, "timeout")
        # the loop answers within a step; if it does not, the lease keeper's hard limit ends the process
        return future.result()

    def _commit(self, job_id: int, row: dict[str, Any]) -> bool:
        """result + succeeded in one transaction; database trouble is retried with backoff for up
        to COMMIT_PATIENCE_S before the result is given up (the job then runs again elsewhere)."""
        deadline, delay = time.monotonic() + COMMIT_PATIENCE_S, 0.5
        while True:
            try:
                return lifecycle.complete(self.settings.database_url, job_id, self.worker_id, row)
            except (OperationalError, DBAPIError) as exc:
                if not is_transient(exc) or time.monotonic() + delay > deadline:
                    raise
                log.warning("job %s: database unavailable for its result (%s); retrying in %.1f s", job_id,
                            type(exc).__name__, delay)
                time.sleep(delay)
                delay = min(delay * 2, 10.0)

    def _fail(self, job_id: int, exc: EngineError) -> str:
        lifecycle.fail(self.settings.database_url, job_id, self.worker_id, exc.kind, exc.message, exc.retryable)
        log.info("job %s failed: %s: %s", job_id, exc.kind, exc.message)
        return "failed"


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


_current_runner: Optional[JobRunner] = None


def set_current_runner(runner: Optional[JobRunner]) -> None:
    global _current_runner
    _current_runner = runner


def current_runner() -> JobRunner:
    if _current_runner is None:
        raise RuntimeError("no JobRunner in this process: tasks run inside `batchd worker`")
    return _current_runner
