"""Prometheus metrics, job events and Celery task states, as an operator meets them.

- `WorkerMetrics` and `RelayMetrics` served over HTTP by prometheus-client and read back with
  its parser: tokens/s, batch occupancy, KV pool use, acceptance by position; jobs by state and
  queue depth from the real database and Redis;
- a real `batchd worker` with BATCHD_METRICS_PORT: its metrics count the jobs it ran, `batchd
  health --worker` passes against it, and the Celery events Flower reads say a failed job's
  task failed (with the job's error) and a succeeded job's task succeeded;
- `batchd events JOB` prints a job's history; the relay logs what it published and requeued at
  the default log level.
"""
from __future__ import annotations

import json
import logging
import socket
import threading
import urllib.request
from datetime import timedelta

import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from batchd.db.models import Job, JobStatus
from batchd.db.session import session_scope
from batchd.db.types import utcnow
from batchd.jobs import lifecycle
from batchd.jobs.inputs import JobInput
from batchd.jobs.publish import Publisher
from batchd.jobs.submit import submit_jobs
from batchd.metrics import RelayMetrics, WorkerMetrics
from batchd.queue.celery_app import configure
from batchd.relay import Relay, show_relay_logs
from tests.service.batch_history import WORKER, PastJob, write_batch
from tests.service.conftest import WorkerProcess, batchd_cli, service_env, wait_for


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted label pairs): value} from a /metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def worker_metrics():
    clock = FakeClock()
    metrics = WorkerMetrics("m", "w1", max_jobs=8, rate_window_s=10, clock=clock)
    port = metrics.serve(0, addr="127.0.0.1")
    yield metrics, port, clock
    metrics.shutdown()


def test_worker_metrics_give_tokens_per_second_occupancy_and_kv_use(worker_metrics):
    metrics, port, clock = worker_metrics
    for _ in range(4):                      # 4 steps of 6 sequences over 8 s: 3 tokens/s
        clock.now += 2
        metrics.observe_step(6, kv_blocks_used=30, kv_blocks_total=120, in_flight=7)
    samples = scrape(port)
    assert value(samples, "batchd_worker_tokens_per_second", model="m") == pytest.approx(24 / 8)
    assert value(samples, "batchd_worker_batch_occupancy_ratio", model="m") == pytest.approx(6 / 8)
    assert value(samples, "batchd_worker_kv_pool_use_ratio", model="m") == pytest.approx(30 / 120)
    assert value(samples, "batchd_worker_jobs_in_flight", model="m") == 7
    assert value(samples, "batchd_worker_steps_total", model="m") == 4
    clock.now += 30                          # nothing for longer than the window: no tokens/s
    assert value(scrape(port), "batchd_worker_tokens_per_second", model="m") == 0


def test_worker_metrics_count_jobs_and_acceptance_by_position(worker_metrics):
    metrics, port, _ = worker_metrics
    metrics.observe_job("succeeded", prompt_tokens=100, generated_tokens=40, spec_offered=60, spec_accepted=30,
                        spec_steps=30, acceptance_per_position=[0.8, 0.4], seconds=3.0)
    metrics.observe_job("succeeded", prompt_tokens=50, generated_tokens=10, spec_offered=20, spec_accepted=4,
                        spec_steps=10, acceptance_per_position=[0.4], seconds=1.0)
    metrics.observe_job("failed", error_kind="too_long")
    samples = scrape(port)
    assert value(samples, "batchd_worker_jobs_total", model="m", status="succeeded", error_kind="") == 2
    assert value(samples, "batchd_worker_jobs_total", model="m", status="failed", error_kind="too_long") == 1
    assert value(samples, "batchd_worker_generated_tokens_total", model="m") == 50
    assert value(samples, "batchd_worker_spec_acceptance_ratio", model="m") == pytest.approx(34 / 80)
    # position 1: (0.8 x 30 steps + 0.4 x 10 steps) / 40 steps; position 2: the first job's alone
    assert value(samples, "batchd_worker_spec_acceptance_by_position", model="m", position="1") == pytest.approx(0.7)
    assert value(samples, "batchd_worker_spec_acceptance_by_position", model="m", position="2") == pytest.approx(0.4)
    assert value(samples, "batchd_worker_job_seconds_count", model="m") == 2


def test_relay_metrics_give_jobs_by_state_and_queue_depth(settings, redis_url, redis_client):
    write_batch(settings, "mix", [PastJob("ok", "a", claimed_ago=5, finished_ago=1, prompt_tokens=3,
                                          generated_tokens=2),
                                  PastJob("bad", "b", outcome="failed", claimed_ago=5, finished_ago=1),
                                  PastJob("busy", "c", outcome="running", claimed_ago=2),
                                  *(PastJob(f"wait-{i}", "d", outcome="pending") for i in range(3))])
    publisher = Publisher(settings, configure(settings, redis_url))
    relay = Relay(settings, publisher)
    metrics = RelayMetrics(settings.database_url, relay.queue_depths)
    relay.metrics = metrics
    port = metrics.serve(0, addr="127.0.0.1")
    try:
        assert relay.run_once().published == 3
        samples = scrape(port)
        model = settings.model_name
        by_state = {status.value: value(samples, "batchd_jobs", model=model, status=status.value)
                    for status in JobStatus}
        assert by_state == {"pending": 0, "queued": 3, "running": 1, "succeeded": 1, "failed": 1, "cancelled": 0,
                            "expired": 0}
        assert value(samples, "batchd_queue_depth", queue=settings.queue_name) == redis_client.llen(settings.queue_name) == 3
        assert value(samples, "batchd_relay_published_total") == 3
    finally:
        metrics.shutdown()


def test_relay_logs_what_it_published_and_requeued_at_the_default_level(settings, redis_url, caplog):
    ids = submit_jobs(settings, "logged", [JobInput(custom_id=f"j{i}", source="t", prompt="p") for i in range(3)]).job_ids
    root, relay_logger = logging.getLogger(), logging.getLogger("batchd.relay")
    saved = root.level, relay_logger.level
    root.setLevel(logging.WARNING)                      # what `batchd relay` sets without -v
    try:
        show_relay_logs()
        relay = Relay(settings, Publisher(settings, configure(settings, redis_url)))
        relay.run_once()
        assert lifecycle.claim(settings.database_url, ids[0], WORKER, 60) is not None
        with session_scope(settings.database_url) as session:   # its worker vanished: the lease ran out
            session.execute(sa.update(Job).where(Job.id == ids[0]).values(lease_expires_at=utcnow() - timedelta(1)))
        relay.run_once()
    finally:
        root.setLevel(saved[0])
        relay_logger.setLevel(saved[1])
    lines = [r.getMessage() for r in caplog.records if r.name == "batchd.relay"]
    assert f"relay: published 3 pending job(s) to {settings.queue_name}: {ids[0]}-{ids[2]}" in lines, lines
    assert f"relay: requeued 1 running job(s) of worker {WORKER}, whose lease expired: {ids[0]}" in lines, lines


def test_events_command_prints_a_jobs_history(settings, redis_url, queue_prefix, tmp_path):
    ids = write_batch(settings, "hist", [PastJob("doc", "x", outcome="failed", claimed_ago=5, finished_ago=1,
                                                 error_kind="too_long", error_message="the prompt has 9000 tokens")])
    env = service_env(settings.database_url, redis_url, tmp_path / "data", queue_prefix)
    by_id = batchd_cli(["events", str(ids["doc"])], env)
    assert by_id.returncode == 0, by_id.stderr.decode()
    lines = by_id.stdout.decode().splitlines()
    assert lines[0] == f"job {ids['doc']}: doc of batch hist, failed, 1 attempt(s)"
    assert [line.split()[3] for line in lines[1:]] == ["submitted", "running", "failed"]
    assert lines[-1].endswith("too_long: the prompt has 9000 tokens") and f"[{WORKER}]" in lines[-1]
    by_custom_id = batchd_cli(["events", "doc", "--batch", "hist", "--json"], env)
    assert [json.loads(line)["event"] for line in by_custom_id.stdout.decode().splitlines()] == \
        ["submitted", "running", "failed"]
    missing = batchd_cli(["events", "nope", "--batch", "hist"], env)
    assert missing.returncode == 1 and missing.stderr.decode().startswith("Error: no job 'nope' in batch 'hist'")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TaskEvents(threading.Thread):
    """What Flower reads: the Celery task events of the worker's tasks, by task id."""

    def __init__(self, app):
        super().__init__(daemon=True)
        self.app, self.events, self.receiver = app, [], None

    def run(self):
        with self.app.connection_for_read() as connection:
            self.receiver = self.app.events.Receiver(connection, handlers={"*": self.events.append})
            self.receiver.capture(limit=None, timeout=None, wakeup=True)

    def stop(self):
        if self.receiver is not None:
            self.receiver.should_stop = True

    def states(self, job_id: int) -> list[tuple[str, dict]]:
        task_ids = {e["uuid"] for e in list(self.events) if e["type"] == "task-received" and e.get("args") == f"[{job_id}]"}
        return [(e["type"], e) for e in list(self.events) if e.get("uuid") in task_ids]


@pytest.mark.slow
@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_a_real_worker_serves_metrics_health_and_failed_tasks(settings, redis_url, queue_prefix, tmp_path):
    port = free_port()
    env = service_env(settings.database_url, redis_url, tmp_path / "data", queue_prefix,
                      BATCHD_METRICS_PORT=str(port))
    worker = WorkerProcess(env, tmp_path / "worker.log", "--no-relay")
    app = configure(settings, redis_url)
    events = TaskEvents(app)
    try:
        hostname = f"{settings.model_name}.{worker.process.pid}@{socket.gethostname()}"
        wait_for(lambda: app.control.ping(destination=[hostname], timeout=0.5), 240, "the worker to answer a ping",
                 worker=worker)
        assert app.control.enable_events(destination=[hostname], reply=True, timeout=5)   # as Flower does
        events.start()
        wait_for(lambda: events.receiver is not None, 30, "the event receiver")
        report = submit_jobs(settings, "watched", [JobInput(custom_id="good", source="t", prompt="The capital of",
                                                            params={"max_new_tokens": 3}),
                                                   JobInput(custom_id="bad", source="t", prompt="x")])
        good, bad = report.job_ids
        with session_scope(settings.database_url) as session:   # a bad row written by SQL: fails in the worker
            session.execute(sa.update(Job).where(Job.id == bad).values(params={"max_new_tokens": -1}))
        Publisher(settings, app).publish_pending([good, bad])

        def finished() -> bool:
            with session_scope(settings.database_url) as session:
                return all(session.get(Job, i).status in (JobStatus.SUCCEEDED, JobStatus.FAILED) for i in (good, bad))
        wait_for(finished, 240, "both jobs to finish", worker=worker)
        wait_for(lambda: any(t == "task-failed" for t, _ in events.states(bad))
                 and any(t == "task-succeeded" for t, _ in events.states(good)), 60, "the task events")
        [failed] = [e for t, e in events.states(bad) if t == "task-failed"]
        assert "JobFailed" in failed["exception"] and "bad_input" in failed["exception"], failed
        assert not any(t == "task-succeeded" for t, _ in events.states(bad))

        wait_for(lambda: sum(v for (n, _), v in scrape(port).items() if n == "batchd_worker_jobs_total") == 2, 30,
                 "the worker's metrics to count both jobs")
        samples = scrape(port)
        model = settings.model_name
        assert value(samples, "batchd_worker_jobs_total", model=model, status="succeeded", error_kind="") == 1
        assert value(samples, "batchd_worker_jobs_total", model=model, status="failed", error_kind="bad_input") == 1
        with session_scope(settings.database_url) as session:
            generated = session.execute(sa.text("SELECT generated_tokens FROM results WHERE job_id = :j"),
                                        {"j": good}).scalar()
        assert value(samples, "batchd_worker_generated_tokens_total", model=model) == generated
        assert value(samples, "batchd_worker_steps_total", model=model) >= 1
        assert value(samples, "batchd_worker_kv_blocks_total", model=model) > 0
        assert value(samples, "batchd_worker_thread_alive", model=model, thread="engine") == 1

        healthy = batchd_cli(["health", "--worker"], env)
        assert healthy.returncode == 0, healthy.stderr.decode()
        assert healthy.stdout.decode().splitlines()[-1].startswith("worker ok: 0 job(s) in flight")
    finally:
        events.stop()
        worker.stop()
    unhealthy = batchd_cli(["health", "--worker"], env)         # the worker is gone: the check says so
    assert unhealthy.returncode == 1 and "do not answer" in unhealthy.stderr.decode()
