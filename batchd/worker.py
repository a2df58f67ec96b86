"""One worker process: one resident engine on one device, many jobs of one model's queue in flight.

The process holds:
- the engine and the one thread that drives it (batchd.jobs.engine_loop.EngineLoop): every
  job in flight is a sequence of its batch;
- a Celery worker with a threads pool of `max_jobs` threads and prefetch 1: each thread holds one
  message and one job (claim, hand to the loop, wait, commit), so Celery's per-job guarantees
  (acks late, reject on worker lost, the visibility timeout) stay as they were with one job;
- a lease keeper thread that renews the leases of the jobs in flight, takes cancelled jobs out
  of the batch, and ends the process if a job outlives the hard time limit;
- unless told not to, a relay thread.

SIGTERM is Celery's warm shutdown: no new message is taken, the loop drains (jobs in flight run
on for `drain_grace_s`, then are requeued), and the process ends when every thread's job is
committed or released. docs/design.md ("The batched worker") says why threads, not processes.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import uuid
from typing import Callable, Optional

from celery.signals import worker_shutting_down

from batchd.config import Settings
from batchd.jobs import heartbeat, lifecycle
from batchd.jobs.engine_loop import EngineLoop
from batchd.jobs.publish import Publisher
from batchd.jobs.runner import JobRunner, set_current_runner
from batchd.metrics import start_worker_metrics
from batchd.queue.celery_app import configure
from batchd.relay import Relay, start_relay_thread

log = logging.getLogger(__name__)

EXIT_HARD_TIME_LIMIT = 70
# the default --max-jobs counts jobs of this size in the KV pool. Jobs beyond what fits wait inside the
# engine (a thread and a lease each, nothing on the GPU), so the count errs high: at 4,096 + 256 it held
# PFlash's 800-token jobs to ~170 in flight on an H200 (Llama-3-8B shape) where the engine alone ran 256.
TYPICAL_JOB_TOKENS = 1024 + 256
MAX_DEFAULT_JOBS = 256


def new_worker_id(model_name: str) -> str:
    return f"{model_name}@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def load_engine(settings: Settings):
    """The resident target (engine.runtime.Engine) for this worker's model path and device, with
    its batch engine (and so its KV pool) built."""
    from batchd.engine.runtime import Engine, EngineConfig

    started = time.perf_counter()
    engine = Engine.load(settings.model_path, EngineConfig(device=settings.device, dtype=settings.dtype,
                         max_context=settings.max_context, attention=settings.attention,
                         sparse_top_k_blocks=settings.sparse_top_k_blocks))
    log.info("loaded %s on %s in %.1f s", settings.model_path, settings.device, time.perf_counter() - started)
    for note in engine.notes:   # what the checkpoint lacks or sets aside (a V4 MTP layer, or none), at start
        log.info("note: %s", note)
    if engine.device.type == "cuda":
        log.info("warmed up (kernels compiled, decode graph captured) in %.1f s", engine.warm_up())
    pool = engine.batch_engine().cache
    engine.compressor.residency.keep_resident = 1   # PFlash: a drafter that fits stays loaded between jobs
    log.info("KV pool: %d blocks of %d positions (%.1f GiB)", pool.blocks.num_blocks, pool.block_size,
             pool.nbytes / 2**30)
    return engine


def default_max_jobs(engine) -> int:
    """What the KV pool fits of typical (1K-token) jobs, and at least one; jobs beyond what fits
    at a moment wait inside the engine, ready for the next free blocks."""
    batch = engine.batch_engine()
    positions = batch.cache.blocks.num_blocks * batch.cache.block_size
    fits = positions // min(TYPICAL_JOB_TOKENS, engine.max_context)
    return max(1, min(MAX_DEFAULT_JOBS, batch.options.max_running, fits))


class LeaseKeeper(threading.Thread):
    """Every `cancel_poll_s`: jobs no longer ours (cancelled, expired, taken over) leave the batch.
    Every `lease_s / 3`: the leases of the jobs in flight are renewed, and the worker's heartbeat
    (batchd.jobs.heartbeat: which model is served) is refreshed, busy or idle. A job past the hard
    time limit ends the process (the relay then requeues its jobs, and counts the attempt)."""

    def __init__(self, runner: JobRunner, loop: EngineLoop, settings: Settings):
        super().__init__(name="batchd-lease", daemon=True)
        self.runner, self.loop, self.settings = runner, loop, settings
        self.stop_event = threading.Event()

    def run(self) -> None:
        renew_every = self.settings.lease_s / 3
        poll = min(self.settings.cancel_poll_s, renew_every)
        last_renewal = last_beat = time.monotonic()
        while not self.stop_event.wait(poll):
            if time.monotonic() - last_beat >= renew_every:
                last_beat = time.monotonic()
                self.beat()
            jobs = self.runner.in_flight()
            if not jobs:
                continue
            now = time.monotonic()
            for job in jobs:
                if now - job.started_monotonic > self.settings.job_time_limit_s:
                    log.critical("job %s ran past the hard time limit (%.0f s): exiting", job.job_id,
                                 self.settings.job_time_limit_s)
                    os._exit(EXIT_HARD_TIME_LIMIT)
            ids = [job.job_id for job in jobs]
            try:
                if now - last_renewal >= renew_every:
                    ours = lifecycle.renew_leases(self.settings.database_url, ids, self.runner.worker_id,
                                                  self.settings.lease_s)
                    last_renewal = now
                else:
                    ours = lifecycle.still_ours(self.settings.database_url, ids, self.runner.worker_id)
            except Exception:
                log.exception("could not check or renew the leases of %d jobs", len(ids))
                continue
            for job_id in set(ids) - ours:
                if job_id in {j.job_id for j in self.runner.in_flight()}:   # not just committed by its thread
                    log.warning("job %s is no longer ours (cancelled or taken over): out of the batch", job_id)
                    self.loop.cancel(job_id, "cancelled")

    def beat(self) -> None:
        try:
            heartbeat.beat(self.settings.database_url, self.runner.worker_id)
        except Exception:   # the database is down: the next beat says it again
            log.warning("could not record this worker's heartbeat", exc_info=True)


def run_worker(settings: Settings, engine, broker_url: str, *, relay: bool = True,
               stop_when: Optional[Callable[[], bool]] = None, loglevel: str = "INFO", quiet: bool = False) -> None:
    """Consume this model's queue until SIGTERM/SIGINT (or until `stop_when()` is true)."""
    max_jobs = settings.max_jobs or default_max_jobs(engine)
    app = configure(settings, broker_url, concurrency=max_jobs)
    import batchd.queue.tasks  # noqa: F401  registers the task on the app

    worker_id = new_worker_id(settings.model_name)
    heartbeat.register_worker(settings.database_url, worker_id, settings.model_name)
    metrics = start_worker_metrics(settings, worker_id, max_jobs)   # None unless BATCHD_METRICS_PORT
    loop = EngineLoop(engine, on_step=metrics.observe_loop if metrics else None)
    loop.start()
    runner = JobRunner(settings, loop, worker_id)
    set_current_runner(runner)
    keeper = LeaseKeeper(runner, loop, settings)
    keeper.start()

    def drain(**_):
        log.info("shutting down: %d jobs in flight get %.0f s to finish", loop.in_flight, settings.drain_grace_s)
        loop.drain(settings.drain_grace_s)

    worker_shutting_down.connect(drain, weak=False)
    relay_thread, relay_stop = None, None
    if relay:
        relay_thread, relay_stop = start_relay_thread(Relay(settings, Publisher(settings, app)))
    if stop_when is not None:
        threading.Thread(target=_stop_when, args=(stop_when,), name="batchd-stop-when", daemon=True).start()
    log.info("worker %s: up to %d jobs in flight", worker_id, max_jobs)
    try:
        worker = app.Worker(hostname=f"{settings.model_name}.{os.getpid()}@{socket.gethostname()}",
                            queues=[settings.queue_name], pool="threads", concurrency=max_jobs, loglevel=loglevel,
                            without_mingle=True, without_gossip=True, optimization="fair", quiet=quiet)
        worker.start()
    finally:
        # stop our threads before the interpreter tears down native libraries under them
        worker_shutting_down.disconnect(drain)
        loop.stop()
        loop.join(timeout=30)
        keeper.stop_event.set()
        if relay_stop is not None:
            relay_stop.set()
            relay_thread.join(timeout=30)
        keeper.join(timeout=30)
        set_current_runner(None)


def _stop_when(predicate: Callable[[], bool], poll_s: float = 0.5) -> None:
    """Ask the worker for a warm shutdown (finish the current job, then stop) once `predicate()`."""
    while True:
        try:
            if predicate():
                break
        except Exception:
            log.exception("stop condition failed")
        time.sleep(poll_s)
    os.kill(os.getpid(), signal.SIGTERM)
