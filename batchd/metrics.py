"""Prometheus metrics (prometheus-client) of a worker and of the relay.

A worker serves what only it knows, from its engine loop and its jobs:

    metrics = WorkerMetrics(model_name="smollm2-135m", worker_id=..., max_jobs=64)
    metrics.observe_step(batch_size=12, kv_blocks_used=300, kv_blocks_total=1024, tokens=12)
    metrics.observe_job("succeeded", prompt_tokens=4096, generated_tokens=256, ...)
    metrics.serve(port=9101)

  batchd_worker_jobs_total{model,status,error_kind}   jobs this worker finished
  batchd_worker_jobs_in_flight{model}                 jobs in its batch now
  batchd_worker_batch_size{model}                     sequences in the last engine step
  batchd_worker_batch_occupancy_ratio{model}          ... over --max-jobs
  batchd_worker_kv_blocks_used / _total{model}        the paged KV pool
  batchd_worker_kv_pool_use_ratio{model}
  batchd_worker_tokens_per_second{model}              tokens the steps produced, last 60 s
  batchd_worker_step_tokens_total{model}              ... since the worker started
  batchd_worker_prompt_tokens_total, _generated_tokens_total{model}   of finished jobs
  batchd_worker_spec_draft_tokens_offered_total, _accepted_total{model}
  batchd_worker_spec_acceptance_ratio{model}          accepted / offered since start
  batchd_worker_spec_acceptance_by_position{model,position}   mean P(accept), weighted by steps
  batchd_worker_job_seconds{model}                    histogram of a job's engine seconds
  batchd_worker_thread_alive{model,thread}            the engine loop and lease keeper threads
  batchd_worker_seconds_since_step{model}             how long ago the engine last stepped
  (`batchd health --worker` reads the last two: the compose worker's healthcheck)

The relay serves the record's view, read at each scrape from the database and the broker (so
any number of workers can come and go without double counting):

  batchd_jobs{model,status}                           jobs by state, every state present
  batchd_queue_depth{queue}                           messages waiting in each model's queue
  batchd_relay_{published,requeued,republished,expired,lost}_total, batchd_relay_pass_failures_total

Each object has its own registry, so two of them in one process (tests, `batchd run`) do not
collide; `serve()` starts prometheus-client's HTTP server on a daemon thread.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Iterable, Optional, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from sqlalchemy import func, select

from batchd.db.models import Job, JobStatus

log = logging.getLogger(__name__)

RATE_WINDOW_S = 60.0
WORKER_THREADS = {"engine": "batchd-engine", "lease": "batchd-lease"}   # batchd.worker's thread names
JOB_SECONDS_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, float("inf"))


class _Served:
    registry: CollectorRegistry

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve /metrics on `port` (0: any free port); the port it listens on."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self.server = server
        return server.server_address[1]

    def shutdown(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.shutdown()
            server.server_close()


class WorkerMetrics(_Served):
    """A worker's metrics; `observe_*` are cheap and thread-safe (the engine loop and the task
    threads call them), the rates are computed when Prometheus scrapes."""

    def __init__(self, model_name: str, worker_id: str, max_jobs: int, *, rate_window_s: float = RATE_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic):
        self.registry = CollectorRegistry()
        self.model, self.max_jobs, self.rate_window_s, self.clock = model_name, max_jobs, rate_window_s, clock
        self._lock = threading.Lock()
        self._recent_tokens: deque[tuple[float, int]] = deque()   # (when, tokens) of steps in the window
        self._started = clock()
        self._by_position: dict[int, list[float]] = {}           # position -> [sum of rate x steps, steps]
        self._offered = self._accepted = 0
        self._last_step = clock()
        labels, registry, m = ["model"], self.registry, [model_name]
        self.jobs = Counter("batchd_worker_jobs", "Jobs this worker finished.", ["model", "status", "error_kind"],
                            registry=registry)
        self.in_flight = Gauge("batchd_worker_jobs_in_flight", "Jobs in this worker's batch.", labels,
                               registry=registry).labels(*m)
        self.batch_size = Gauge("batchd_worker_batch_size", "Sequences in the last engine step.", labels,
                                registry=registry).labels(*m)
        self.occupancy = Gauge("batchd_worker_batch_occupancy_ratio", "Sequences in the last step over --max-jobs.",
                               labels, registry=registry).labels(*m)
        self.kv_used = Gauge("batchd_worker_kv_blocks_used", "KV pool blocks in use.", labels,
                             registry=registry).labels(*m)
        self.kv_total = Gauge("batchd_worker_kv_blocks_total", "KV pool blocks.", labels, registry=registry).labels(*m)
        self.kv_use = Gauge("batchd_worker_kv_pool_use_ratio", "KV pool blocks in use over all blocks.", labels,
                            registry=registry).labels(*m)
        Gauge("batchd_worker_tokens_per_second", f"Tokens the engine steps produced per second, last "
              f"{rate_window_s:g} s.", labels, registry=registry).labels(*m).set_function(self.tokens_per_second)
        self.step_tokens = Counter("batchd_worker_step_tokens", "Tokens the engine steps produced.", labels,
                                   registry=registry).labels(*m)
        self.steps = Counter("batchd_worker_steps", "Engine steps.", labels, registry=registry).labels(*m)
        self.prompt_tokens = Counter("batchd_worker_prompt_tokens", "Prompt tokens of finished jobs.", labels,
                                     registry=registry).labels(*m)
        self.generated_tokens = Counter("batchd_worker_generated_tokens", "Generated tokens of finished jobs.", labels,
                                        registry=registry).labels(*m)
        self.offered = Counter("batchd_worker_spec_draft_tokens_offered", "Draft tokens offered to verification.",
                               labels, registry=registry).labels(*m)
        self.accepted = Counter("batchd_worker_spec_draft_tokens_accepted", "Draft tokens accepted.", labels,
                                registry=registry).labels(*m)
        Gauge("batchd_worker_spec_acceptance_ratio", "Accepted over offered draft tokens since the worker started.",
              labels, registry=registry).labels(*m).set_function(self.acceptance_ratio)
        self.by_position = Gauge("batchd_worker_spec_acceptance_by_position",
                                 "P(draft accepted | offered) at each draft position, jobs weighted by their steps.",
                                 ["model", "position"], registry=registry)
        alive = Gauge("batchd_worker_thread_alive", "1 while the worker's thread runs.", ["model", "thread"],
                      registry=registry)
        for thread, name in WORKER_THREADS.items():
            alive.labels(model_name, thread).set_function(lambda name=name: float(_thread_alive(name)))
        Gauge("batchd_worker_seconds_since_step", "Seconds since the engine's last step (or since the worker "
              "started).", labels, registry=registry).labels(*m).set_function(lambda: self.clock() - self._last_step)
        self.job_seconds = Histogram("batchd_worker_job_seconds", "A job's seconds in the engine.", labels,
                                     buckets=JOB_SECONDS_BUCKETS, registry=registry).labels(*m)

    # ---- from the engine loop ---------------------------------------------------------------

    def observe_step(self, batch_size: int, kv_blocks_used: int, kv_blocks_total: int, *,
                     tokens: Optional[int] = None, in_flight: Optional[int] = None) -> None:
        """One engine step: `batch_size` sequences ran, `tokens` came out of it (default: one per
        sequence), the KV pool holds `kv_blocks_used` of `kv_blocks_total` blocks."""
        tokens = batch_size if tokens is None else tokens
        now = self.clock()
        with self._lock:
            self._recent_tokens.append((now, tokens))
            self._drop_old(now)
            self._last_step = now
        self.steps.inc()
        self.step_tokens.inc(tokens)
        self.batch_size.set(batch_size)
        self.occupancy.set(batch_size / self.max_jobs if self.max_jobs else 0.0)
        self.kv_used.set(kv_blocks_used)
        self.kv_total.set(kv_blocks_total)
        self.kv_use.set(kv_blocks_used / kv_blocks_total if kv_blocks_total else 0.0)
        if in_flight is not None:
            self.in_flight.set(in_flight)

    def observe_loop(self, stats) -> None:
        """`EngineLoop(on_step=...)`: a batchd.jobs.engine_loop.LoopStats; its decode sequences
        each produced a token."""
        self.observe_step(stats.decoding, stats.kv_blocks_used, stats.kv_blocks_total, tokens=stats.decoding,
                          in_flight=stats.in_flight)

    # ---- from the jobs ------------------------------------------------------------------------

    def observe_job(self, status: str, *, error_kind: Optional[str] = None, prompt_tokens: int = 0,
                    generated_tokens: int = 0, spec_offered: int = 0, spec_accepted: int = 0, spec_steps: int = 0,
                    acceptance_per_position: Sequence[float] = (), seconds: Optional[float] = None) -> None:
        """A job left this worker: succeeded, failed (with its kind), cancelled, ..."""
        self.jobs.labels(self.model, status, error_kind or "").inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(generated_tokens)
        self.offered.inc(spec_offered)
        self.accepted.inc(spec_accepted)
        if seconds is not None:
            self.job_seconds.observe(seconds)
        with self._lock:
            self._offered += spec_offered
            self._accepted += spec_accepted
            if spec_steps and acceptance_per_position:
                self._add_positions(acceptance_per_position, spec_steps)

    def _add_positions(self, rates: Sequence[float], steps: int) -> None:
        for position, rate in enumerate(rates, start=1):
            weighted = self._by_position.setdefault(position, [0.0, 0.0])
            weighted[0] += rate * steps
            weighted[1] += steps
            self.by_position.labels(self.model, str(position)).set(weighted[0] / weighted[1])

    def observe_result_row(self, status: str, row: Optional[dict], error_kind: Optional[str] = None) -> None:
        """`observe_job` from a `job_results`-shaped row (None: the job has no result)."""
        row = row or {}
        self.observe_job(status, error_kind=error_kind, prompt_tokens=row.get("prompt_tokens") or 0,
                         generated_tokens=row.get("generated_tokens") or 0,
                         spec_offered=row.get("spec_draft_tokens_offered") or 0,
                         spec_accepted=row.get("spec_draft_tokens_accepted") or 0,
                         spec_steps=row.get("spec_steps") or 0,
                         acceptance_per_position=row.get("acceptance_per_position") or (),
                         seconds=row.get("total_s"))

    # ---- computed at scrape -------------------------------------------------------------------

    def tokens_per_second(self) -> float:
        now = self.clock()
        with self._lock:
            self._drop_old(now)
            tokens = sum(n for _, n in self._recent_tokens)
        span = min(self.rate_window_s, now - self._started)
        return tokens / span if span > 0 else 0.0

    def acceptance_ratio(self) -> float:
        with self._lock:
            return self._accepted / self._offered if self._offered else 0.0

    def _drop_old(self, now: float) -> None:
        while self._recent_tokens and self._recent_tokens[0][0] < now - self.rate_window_s:
            self._recent_tokens.popleft()


def _thread_alive(name: str) -> bool:
    return any(thread.name == name and thread.is_alive() for thread in threading.enumerate())


class RelayMetrics(_Served):
    """The relay's counters, and jobs by state and queue depth read at each scrape."""

    ACTIONS = ("published", "requeued", "republished", "expired", "lost")

    def __init__(self, database_url: str, queue_lengths: Callable[[], dict[str, int]]):
        """`queue_lengths()`: {queue name: messages waiting} (the relay's publisher knows the broker)."""
        self.registry = CollectorRegistry()
        self.actions = {action: Counter(f"batchd_relay_{action}", f"Jobs the relay {action}.", registry=self.registry)
                        for action in self.ACTIONS}
        self.pass_failures = Counter("batchd_relay_pass_failures", "Relay passes that failed (database or broker "
                                     "down).", registry=self.registry)
        self.registry.register(RecordCollector(database_url, queue_lengths))

    def observe_pass(self, report) -> None:
        """A batchd.relay.RelayReport."""
        for action in self.ACTIONS:
            self.actions[action].inc(getattr(report, action))


class RecordCollector:
    """batchd_jobs{model,status} from the jobs table and batchd_queue_depth{queue} from the
    broker, read when Prometheus scrapes; a source that cannot be read is left out (and logged)."""

    def __init__(self, database_url: str, queue_lengths: Callable[[], dict[str, int]]):
        self.database_url, self.queue_lengths = database_url, queue_lengths

    def describe(self) -> Iterable:
        return []   # read at scrape, not at registration

    def collect(self) -> Iterable[GaugeMetricFamily]:
        try:
            counts = jobs_by_state(self.database_url)
        except Exception as exc:
            log.warning("metrics: cannot count jobs by state: %s", exc)
        else:
            jobs = GaugeMetricFamily("batchd_jobs", "Jobs by model and state (the database's record).",
                                     labels=["model", "status"])
            for model in sorted(counts):
                for status in JobStatus:
                    jobs.add_metric([model, status.value], counts[model].get(status.value, 0))
            yield jobs
        try:
            lengths = self.queue_lengths()
        except Exception as exc:
            log.warning("metrics: cannot read the queues' depth: %s", exc)
        else:
            depth = GaugeMetricFamily("batchd_queue_depth", "Messages waiting in a model's queue.", labels=["queue"])
            for queue, length in sorted(lengths.items()):
                depth.add_metric([queue], length)
            yield depth


def jobs_by_state(database_url: str) -> dict[str, dict[str, int]]:
    """{model: {status: jobs}}; jobs without a model yet count under ""."""
    from batchd.db.session import read_scope

    counts: dict[str, dict[str, int]] = {}
    with read_scope(database_url) as session:
        for model, status, n in session.execute(select(Job.model, Job.status, func.count())
                                                .group_by(Job.model, Job.status)):
            counts.setdefault(model or "", {})[JobStatus(status).value] = int(n)
    return counts


# ---- a worker's wiring ---------------------------------------------------------------------

RESULT_FIELDS = ("prompt_tokens", "generated_tokens", "spec_draft_tokens_offered", "spec_draft_tokens_accepted",
                 "spec_steps", "acceptance_per_position", "total_s")


def start_worker_metrics(settings, worker_id: str, max_jobs: int) -> Optional[WorkerMetrics]:
    """The worker's metrics served on BATCHD_METRICS_PORT (None when it is not set), following
    its jobs' outcomes; pass `observe_loop` to the engine loop's `on_step`."""
    if not settings.metrics_port:
        return None
    metrics = WorkerMetrics(settings.model_name, worker_id, max_jobs)
    port = metrics.serve(settings.metrics_port)
    follow_task_outcomes(metrics, settings.database_url)
    log.info("metrics on :%d/metrics", port)
    return metrics


def follow_task_outcomes(metrics: WorkerMetrics, database_url: str) -> None:
    """Count each job a task of this process finished, with its result's tokens and speculation,
    read back from the database (one primary-key read per job) when its Celery task ends."""
    from celery.signals import task_postrun

    from batchd.jobs.publish import TASK_NAME

    def on_task_end(task=None, args=None, retval=None, state=None, **_):
        if getattr(task, "name", None) != TASK_NAME or state == "RETRY" or retval in ("ignored", "discarded"):
            return
        try:
            finished = finished_job(database_url, int(args[0]))
        except Exception:
            log.exception("metrics: could not read job %s back", args)
            return
        if finished is not None:
            status, error_kind, row = finished
            metrics.observe_result_row(status, row, error_kind)

    task_postrun.connect(on_task_end, weak=False)
    metrics.stop_following = lambda: task_postrun.disconnect(on_task_end)


def finished_job(database_url: str, job_id: int) -> Optional[tuple[str, Optional[str], Optional[dict]]]:
    """(status, error kind, result fields or None) of a finished job; None while it is not finished."""
    import json

    from batchd.db.models import FINISHED, Result
    from batchd.db.session import read_scope

    columns = [getattr(Result, name) for name in RESULT_FIELDS]
    with read_scope(database_url) as session:
        row = session.execute(select(Job.status, Job.error_kind, Result.job_id, *columns)
                              .outerjoin(Result, Result.job_id == Job.id).where(Job.id == job_id)).mappings().first()
    if row is None or JobStatus(row["status"]) not in FINISHED:
        return None
    result = {name: row[name] for name in RESULT_FIELDS} if row["job_id"] is not None else None
    if result and isinstance(result["acceptance_per_position"], str):
        result["acceptance_per_position"] = json.loads(result["acceptance_per_position"])
    return JobStatus(row["status"]).value, row["error_kind"], result
