"""One worker process: one resident engine on one device, serving one model's queue.

The process holds: the engine (loaded once, before consuming), a Celery worker (solo pool,
in this main thread), a lease keeper thread that renews the running job's lease and ends the
process if a job outlives the hard time limit, and, unless told not to, a relay thread.
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

from batchd.config import Settings
from batchd.jobs import lifecycle
from batchd.jobs.publish import Publisher
from batchd.jobs.runner import JobRunner, set_current_runner
from batchd.queue.celery_app import configure
from batchd.relay import Relay, start_relay_thread

log = logging.getLogger(__name__)

EXIT_HARD_TIME_LIMIT = 70


def new_worker_id(model_name: str) -> str:
    return f"{model_name}@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def load_engine(settings: Settings):
    """The resident target (engine.runtime.Engine) for this worker's model path and device."""
    from batchd.engine.runtime import Engine, EngineConfig

    started = time.perf_counter()
    engine = Engine.load(settings.model_path, EngineConfig(device=settings.device, dtype=settings.dtype,
                         max_context=settings.max_context, attention=settings.attention,
                         sparse_top_k_blocks=settings.sparse_top_k_blocks))
    log.info("loaded %s on %s in %.1f s", settings.model_path, settings.device, time.perf_counter() - started)
    if engine.device.type == "cuda":
        log.info("warmed up (kernels compiled, decode graph captured) in %.1f s", engine.warm_up())
    return engine


class LeaseKeeper(threading.Thread):
    """Renews the running job's lease every lease_s / 3; past the hard time limit, exits the
    process (the relay then requeues the job, and counts the attempt)."""

    def __init__(self, runner: JobRunner, settings: Settings):
        super().__init__(name="batchd-lease", daemon=True)
        self.runner, self.settings = runner, settings
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(self.settings.lease_s / 3):
            job = self.runner.current
            if job is None:
                continue
            if time.monotonic() - job.started_monotonic > self.settings.job_time_limit_s:
                log.critical("job %s ran past the hard time limit (%.0f s): exiting", job.job_id,
                             self.settings.job_time_limit_s)
                os._exit(EXIT_HARD_TIME_LIMIT)
            try:
                if not lifecycle.renew_lease(self.settings.database_url, job.job_id, self.runner.worker_id,
                                             self.settings.lease_s):
                    log.warning("job %s is no longer ours (cancelled or taken over)", job.job_id)
            except Exception:
                log.exception("could not renew the lease of job %s", job.job_id)


def run_worker(settings: Settings, engine, broker_url: str, *, relay: bool = True,
               stop_when: Optional[Callable[[], bool]] = None, loglevel: str = "INFO", quiet: bool = False) -> None:
    """Consume this model's queue until SIGTERM/SIGINT (or until `stop_when()` is true)."""
    app = configure(settings, broker_url)
    import batchd.queue.tasks  # noqa: F401  registers the task on the app

    worker_id = new_worker_id(settings.model_name)
    runner = JobRunner(settings, engine, worker_id)
    set_current_runner(runner)
    keeper = LeaseKeeper(runner, settings)
    keeper.start()
    relay_thread, relay_stop = None, None
    if relay:
        relay_thread, relay_stop = start_relay_thread(Relay(settings, Publisher(settings, app)))
    if stop_when is not None:
        threading.Thread(target=_stop_when, args=(stop_when,), name="batchd-stop-when", daemon=True).start()
    try:
        worker = app.Worker(hostname=f"{settings.model_name}.{os.getpid()}@{socket.gethostname()}",
                            queues=[settings.queue_name], pool="solo", concurrency=1, loglevel=loglevel,
                            without_mingle=True, without_gossip=True, optimization="fair", quiet=quiet)
        worker.start()
    finally:
        # stop our threads before the interpreter tears down native libraries under them
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
