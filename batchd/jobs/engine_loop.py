"""The one thread that drives a worker's engine: jobs join the batch as they arrive.

    loop = EngineLoop(engine); loop.start()
    future = loop.submit(job_id, request)      # from any thread (a Celery task's thread)
    outcome = future.result()                  # a LoopOutcome, when the job leaves the batch
    loop.cancel(job_id, "cancelled")           # it leaves within the next step

Only this thread touches the engine (CUDA state, the KV pool, the scheduler). Each turn it takes
the new jobs (encoding and PFlash compression run here; the PFlash jobs that arrived together
share one drafter visit), applies cancels,
then runs one engine step and resolves the futures of the jobs that finished in it. When it has
nothing to run it waits for the next job.

Failures stay with their job: a job's `EngineError` (bad input, too long, its drafter failed)
resolves that job's future only. Out of device memory in a step drops the batch's sequences
and hands their jobs back to the queue (`requeue`), never a failure. Any other exception in a
step is a bug: the traceback is logged and the jobs in flight are requeued, at most
`MAX_STEP_FAILURES` times in a row, after which they fail as `internal` (a poison batch must
not loop forever).

`drain(grace_s)` (SIGTERM): the jobs in flight (claimed ones on their way in included) run on,
and those still running when the grace period ends are requeued, as is any job that arrives
after it.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from batchd.engine.batch.generate import BatchSession, Handle
from batchd.engine.errors import EngineError, InternalError
from batchd.engine.types import GenerationRequest, GenerationResult

log = logging.getLogger(__name__)

MAX_STEP_FAILURES = 3


@dataclass(frozen=True)
class LoopOutcome:
    """How a job left the batch: exactly one of result, error or `requeue` (a reason), or
    `cancelled` (a reason: "cancelled", "timeout")."""

    result: Optional[GenerationResult] = None
    error: Optional[EngineError] = None
    requeue: Optional[str] = None
    cancelled: Optional[str] = None


@dataclass(eq=False)
class _Job:
    job_id: int
    request: GenerationRequest
    future: Future
    handle: Optional[Handle] = None


@dataclass(frozen=True)
class LoopStats:
    """One step's view of the batch, for metrics and `batchd status`."""

    in_flight: int
    decoding: int
    kv_blocks_used: int
    kv_blocks_total: int
    steps: int


class EngineLoop(threading.Thread):
    def __init__(self, engine, *, idle_wait_s: float = 0.5,
                 on_step: Optional[Callable[[LoopStats], None]] = None):
        super().__init__(name="batchd-engine", daemon=True)
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self.on_step = on_step
        self._inbox: queue.Queue[_Job] = queue.Queue()
        self._cancels: queue.Queue[tuple[int, str]] = queue.Queue()
        self._jobs: dict[int, _Job] = {}          # in the batch (the loop thread's own)
        self._lock = threading.Lock()               # orders submit() against the drain deadline
        self._drain_deadline: Optional[float] = None
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._step_failures = 0
        self.session: Optional[BatchSession] = None
        self.steps = 0
        self.last_step_at = time.monotonic()   # liveness, for the lease keeper

    # ---- any thread ----------------------------------------------------------------------

    def submit(self, job_id: int, request: GenerationRequest) -> Future:
        future: Future = Future()
        with self._lock:
            if self._past_drain_deadline():
                future.set_result(LoopOutcome(requeue="the worker is shutting down"))
                return future
            self._inbox.put(_Job(job_id, request, future))
        self._wake.set()
        return future

    def cancel(self, job_id: int, reason: str = "cancelled") -> None:
        """The job leaves the batch within the next step; its future resolves `cancelled`."""
        self._cancels.put((job_id, reason))
        self._wake.set()

    def drain(self, grace_s: float) -> None:
        """Requeue the jobs still in flight after `grace_s` seconds, and any that come later."""
        with self._lock:
            if self._drain_deadline is None:
                self._drain_deadline = time.monotonic() + grace_s
        self._wake.set()

    def _past_drain_deadline(self) -> bool:
        return self._drain_deadline is not None and time.monotonic() >= self._drain_deadline

    def stop(self) -> None:
        """End the thread after requeueing whatever is in flight (tests, shutdown)."""
        self.drain(0.0)
        self._stopping.set()
        self._wake.set()

    @property
    def in_flight(self) -> int:
        return len(self._jobs) + self._inbox.qsize()

    # ---- the loop thread ------------------------------------------------------------------

    def run(self) -> None:
        try:
            self.session = BatchSession(self.engine)
        except EngineError as exc:   # the target could not be restored: every job fails fast
            log.error("the engine cannot run jobs: %s", exc)
            self._fail_everything_forever(exc)
            return
        while True:
            self._take_new_jobs()
            self._apply_cancels()
            self._requeue_after_drain_deadline()
            if self._stopping.is_set() and not self._jobs:
                break
            if self.session.has_work:
                self._step()
            else:
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
        self._requeue_inbox("the worker is shutting down")

    def _take_new_jobs(self) -> None:
        """Every job waiting in the inbox joins the batch in one `add_many`, so the PFlash jobs
        among them share one drafter visit (one park and unpark, not one per job)."""
        jobs = []
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                break
            if self._past_drain_deadline():
                job.future.set_result(LoopOutcome(requeue="the worker is shutting down"))
                continue
            jobs.append(job)
        if not jobs:
            return
        try:
            outcomes = self.session.add_many([job.request for job in jobs])
        except Exception as exc:  # noqa: BLE001 - add_many keeps errors per job; this is a bug or OOM
            outcomes = [exc] * len(jobs)
        for job, outcome in zip(jobs, outcomes):
            if isinstance(outcome, EngineError):
                job.future.set_result(LoopOutcome(error=outcome))
            elif isinstance(outcome, torch.OutOfMemoryError):
                log.warning("job %s: out of device memory while preparing it; requeued", job.job_id)
                _empty_device_cache(self.engine)
                job.future.set_result(LoopOutcome(requeue="out of device memory while preparing the job"))
            elif isinstance(outcome, Exception):  # a bug: this job fails, the others go on
                log.error("job %s: internal error while preparing it", job.job_id, exc_info=outcome)
                job.future.set_result(LoopOutcome(error=_internal(outcome)))
            else:
                job.handle = outcome
                self._jobs[job.job_id] = job

    def _apply_cancels(self) -> None:
        while True:
            try:
                job_id, reason = self._cancels.get_nowait()
            except queue.Empty:
                return
            job = self._jobs.pop(job_id, None)
            if job is None:
                continue   # finished already, or never joined
            self.session.cancel(job.handle)
            job.future.set_result(LoopOutcome(cancelled=reason))

    def _requeue_after_drain_deadline(self) -> None:
        if not self._jobs or not self._past_drain_deadline():
            return
        log.warning("drain: requeueing %d jobs still in flight", len(self._jobs))
        self._requeue_all("the worker shut down before the job finished")

    def _step(self) -> None:
        try:
            done = self.session.step()
        except torch.OutOfMemoryError:
            log.error("out of device memory in a batch step: requeueing the %d jobs in flight", len(self._jobs))
            self._requeue_all("out of device memory in a batch step")
            _empty_device_cache(self.engine)
            return
        except Exception as exc:
            self._step_failures += 1
            log.exception("batch step failed (%d in a row)", self._step_failures)
            if self._step_failures >= MAX_STEP_FAILURES:
                self._fail_all(_internal(exc))
            else:
                self._requeue_all(f"a batch step failed ({type(exc).__name__})")
            return
        self._step_failures = 0
        self.steps += 1
        self.last_step_at = time.monotonic()
        for handle, result in done:
            job = self._job_of(handle)
            if job is not None and result is not None:
                del self._jobs[job.job_id]
                job.future.set_result(LoopOutcome(result=result))
        if self.on_step is not None:
            self._report_step()

    def _report_step(self) -> None:
        batch = self.session.batch
        pool = batch.cache.blocks
        try:
            self.on_step(LoopStats(in_flight=len(self._jobs), decoding=len(batch.last_plan.decode) if batch.last_plan else 0,
                                   kv_blocks_used=pool.num_blocks - pool.num_free, kv_blocks_total=pool.num_blocks,
                                   steps=self.steps))
        except Exception:
            log.exception("on_step callback failed")

    def _job_of(self, handle: Handle) -> Optional[_Job]:
        for job in self._jobs.values():
            if job.handle is handle:
                return job
        return None

    def _requeue_all(self, reason: str) -> None:
        self._abandon_session()
        for job in self._jobs.values():
            job.future.set_result(LoopOutcome(requeue=reason))
        self._jobs.clear()

    def _fail_all(self, error: EngineError) -> None:
        self._abandon_session()
        for job in self._jobs.values():
            job.future.set_result(LoopOutcome(error=error))
        self._jobs.clear()
        self._step_failures = 0

    def _abandon_session(self) -> None:
        """Free every sequence; if even that fails, start a new batch engine."""
        try:
            self.session.abandon()
        except Exception:
            log.exception("could not free the batch; building a new batch engine")
            self.engine.release_batch_engine()
            self.session = BatchSession(self.engine)

    def _requeue_inbox(self, reason: str) -> None:
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return
            job.future.set_result(LoopOutcome(requeue=reason))

    def _fail_everything_forever(self, error: EngineError) -> None:
        while not self._stopping.is_set():
            try:
                job = self._inbox.get(timeout=self.idle_wait_s)
            except queue.Empty:
                continue
            job.future.set_result(LoopOutcome(error=error))


def _internal(exc: Exception) -> EngineError:
    return InternalError(f"{type(exc).__name__}: {exc} (a bug; the worker log has the traceback)")


def _empty_device_cache(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.empty_cache()
