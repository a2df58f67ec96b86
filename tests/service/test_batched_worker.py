"""A worker with many jobs in flight (real SmolLM2 engine on the CPU, real Redis and PostgreSQL):
the same SHAs as one job at a time, nothing lost or duplicated under SIGKILL, SIGTERM drains, a
cancel takes a job out of the running batch. PostgreSQL only: the worker's code path is the same
on SQLite (tests/service/test_worker.py and test_outages.py run it there), and each of these
tests costs a minute of the suite on 2 cores."""
from __future__ import annotations

import json
import random
import signal
import time
import uuid

import pytest
import sqlalchemy as sa

from batchd.db import migrate
from batchd.db.session import db_engine, dispose_all
from batchd.jobs.progress import workers_in_flight
from tests.service.conftest import (REDIS_HOST, REDIS_PORT, WorkerProcess, _make_database, batchd_cli,
                                    delete_queue_keys, service_env, wait_for)

pytestmark = pytest.mark.slow

BATCH_REDIS_DB = 14
TERMINAL = ("succeeded", "failed", "cancelled", "expired")

# eight jobs of different lengths and parameters: greedy ones (plain, chat, stop string, lookup
# speculation) and a seeded sampling one
JOBS = [
    {"custom_id": "greedy-short", "prompt": "The capital of France is", "params": {"max_new_tokens": 10}},
    {"custom_id": "greedy-long", "prompt": "Write a list of ten fruits, one per line:\n" * 6,
     "params": {"max_new_tokens": 24}},
    {"custom_id": "chat", "messages": [{"role": "user", "content": "Name three colours."}],
     "params": {"max_new_tokens": 16, "chat": True}},
    {"custom_id": "stop", "prompt": "Count: 1, 2, 3,", "params": {"max_new_tokens": 30, "stop": [" 9"]}},
    {"custom_id": "lookup", "prompt": "alpha beta gamma delta alpha beta gamma delta alpha beta",
     "params": {"max_new_tokens": 20, "spec": "lookup"}},
    {"custom_id": "sampled", "prompt": "Once upon a time", "params": {"max_new_tokens": 16, "temperature": 0.8,
                                                                     "seed": 7}},
    {"custom_id": "digits", "prompt": "The year 1984 was followed by", "params": {"max_new_tokens": 12}},
    {"custom_id": "ignore-eos", "prompt": "Hello", "params": {"max_new_tokens": 14, "ignore_eos": True}},
]


@pytest.fixture
def database_url(request, tmp_path) -> str:
    """A migrated PostgreSQL schema (this module's tests do not run on SQLite too)."""
    url = _make_database("postgresql", tmp_path, request)
    migrate.upgrade(url)
    yield url
    dispose_all()


class Service:
    """One database, one Redis queue prefix, and the workers started on them."""

    def __init__(self, database_url: str, tmp_path, request, **env):
        migrate.upgrade(database_url)
        self.database_url, self.tmp_path = database_url, tmp_path
        broker_url = f"redis://{REDIS_HOST}:{REDIS_PORT}/{BATCH_REDIS_DB}"
        prefix = f"batch{uuid.uuid4().hex[:8]}"
        self.env = service_env(database_url, broker_url, tmp_path / "data", prefix, **env)
        self.workers: list[WorkerProcess] = []
        request.addfinalizer(lambda: delete_queue_keys(broker_url, prefix))
        request.addfinalizer(self.kill_all)

    def submit(self, batch: str, jobs: list[dict], *args: str) -> None:
        lines = "\n".join(json.dumps(j) for j in jobs).encode()
        out = batchd_cli(["submit", "-", "--batch", batch, *args], self.env, input=lines)
        assert out.returncode == 0, out.stderr.decode()

    def worker(self, *args: str, **env) -> WorkerProcess:
        worker = WorkerProcess({**self.env, **env}, self.tmp_path / f"worker-{len(self.workers)}.log", *args)
        self.workers.append(worker)
        return worker

    def kill_all(self) -> None:
        for worker in self.workers:
            worker.kill()
        dispose_all()

    def query(self, sql: str, **params) -> list[dict]:
        with db_engine(self.database_url).connect() as connection:
            return [dict(r) for r in connection.execute(sa.text(sql), params).mappings()]

    def rows(self, batch: str) -> dict[str, dict]:
        return {r["custom_id"]: r for r in self.query("SELECT * FROM job_results WHERE batch = :b", b=batch)}

    def statuses(self, batch: str) -> list[str]:
        return [r["status"] for r in self.rows(batch).values()]

    def wait_done(self, batch: str, worker: WorkerProcess, timeout: float = 300) -> dict[str, dict]:
        wait_for(lambda: all(s in TERMINAL for s in self.statuses(batch)), timeout, f"batch {batch} to finish",
                 worker=worker)
        return self.rows(batch)

    def results_per_job(self, batch: str) -> dict[str, int]:
        return {r["custom_id"]: r["n"] for r in self.query(
            "SELECT j.custom_id, COUNT(r.job_id) AS n FROM jobs j JOIN batches b ON b.id = j.batch_id "
            "LEFT JOIN results r ON r.job_id = j.id WHERE b.name = :b GROUP BY j.custom_id", b=batch)}

    def events(self, batch: str, custom_id: str) -> list[str]:
        return [r["event"] for r in self.query(
            "SELECT e.event FROM job_events e JOIN jobs j ON j.id = e.job_id JOIN batches b ON b.id = j.batch_id "
            "WHERE b.name = :b AND j.custom_id = :c ORDER BY e.id", b=batch, c=custom_id)]


def test_eight_in_flight_give_the_shas_of_one_at_a_time(database_url, tmp_path, request):
    service = Service(database_url, tmp_path, request)
    service.submit("alone", [dict(j, custom_id=j["custom_id"]) for j in JOBS])
    one = service.worker("--max-jobs", "1")
    alone = service.wait_done("alone", one)
    assert one.stop() == 0, one.output()[-3000:]

    service.submit("together", JOBS)
    eight = service.worker("--max-jobs", "8")
    wait_for(lambda: any(load.in_flight >= 4 for load in workers_in_flight(database_url)), 240,
             "jobs in flight together", worker=eight)
    together = service.wait_done("together", eight)
    assert eight.stop() == 0, eight.output()[-3000:]

    assert all(r["status"] == "succeeded" for r in alone.values()), alone
    assert all(r["status"] == "succeeded" for r in together.values()), together
    assert {c: r["output_sha256"] for c, r in together.items()} == {c: r["output_sha256"] for c, r in alone.items()}
    # one at a time really was one at a time, and eight at a time shared steps
    assert max(r["batch_size_mean"] for r in alone.values()) == 1.0
    assert max(r["batch_size_mean"] for r in together.values()) > 1.5
    assert all(r["running_s"] > 0 and r["slot_wait_s"] >= 0 and r["preemptions"] == 0 for r in together.values())
    # the worker said how many jobs it holds
    assert "up to 8 jobs in flight" in eight.output()


def test_sigkill_mid_batch_five_times_every_job_done_once(database_url, tmp_path, request):
    service = Service(database_url, tmp_path, request, BATCHD_LEASE_S="3", BATCHD_MAX_ATTEMPTS="10")
    jobs = [{"custom_id": f"doc-{i}", "prompt": f"Count from {i} to forty:", "params": {"max_new_tokens": 24 + 4 * i}}
            for i in range(8)]
    service.submit("killed", jobs)
    chooser = random.Random(5)
    for kill in range(5):
        worker = service.worker("--max-jobs", "4")
        wait_for(lambda: "running" in service.statuses("killed") or
                 all(s in TERMINAL for s in service.statuses("killed")), 240, "a job to start", worker=worker)
        time.sleep(chooser.uniform(0.0, 2.0))   # any moment: before, during or after a step or a commit
        worker.kill()
    last = service.worker("--max-jobs", "4")
    rows = service.wait_done("killed", last, timeout=400)
    assert last.stop() == 0, last.output()[-3000:]

    assert all(r["status"] == "succeeded" for r in rows.values()), {c: r["status"] for c, r in rows.items()}
    assert service.results_per_job("killed") == {f"doc-{i}": 1 for i in range(8)}
    # nothing was lost on the way: at least one job ran more than once, and every one finished once
    assert max(r["attempts"] for r in rows.values()) >= 2
    assert all(service.events("killed", c).count("succeeded") == 1 for c in rows)

    # and the outputs are those of an undisturbed run
    service.submit("undisturbed", jobs)
    calm = service.worker("--max-jobs", "4")
    calm_rows = service.wait_done("undisturbed", calm)
    assert calm.stop() == 0
    assert {c: r["output_sha256"] for c, r in rows.items()} == {c: r["output_sha256"] for c, r in calm_rows.items()}


@pytest.mark.parametrize("grace_s", ["120", "0"], ids=["finishes", "requeues"])
def test_sigterm_drains_the_jobs_in_flight(database_url, tmp_path, request, grace_s):
    service = Service(database_url, tmp_path, request, BATCHD_DRAIN_GRACE_S=grace_s)
    jobs = [{"custom_id": f"doc-{i}", "prompt": f"Story number {i}:", "params": {"max_new_tokens": 48,
                                                                                  "ignore_eos": True}}
            for i in range(6)]
    service.submit("drain", jobs)
    worker = service.worker("--max-jobs", "3")
    wait_for(lambda: service.statuses("drain").count("running") >= 2, 240, "jobs in flight", worker=worker)
    in_flight = [c for c, r in service.rows("drain").items() if r["status"] == "running"]
    worker.process.send_signal(signal.SIGTERM)
    assert worker.process.wait(timeout=180) == 0, worker.output()[-3000:]
    rows = service.rows("drain")
    if grace_s != "0":   # given time, the jobs in flight finish before the worker leaves
        assert all(rows[c]["status"] == "succeeded" for c in in_flight), {c: rows[c]["status"] for c in in_flight}
    else:                # no time: they go back to the queue, released by this worker
        assert all(rows[c]["status"] == "queued" for c in in_flight), {c: rows[c]["status"] for c in in_flight}
        assert all("released" in service.events("drain", c) for c in in_flight)
    assert "running" not in service.statuses("drain")
    # a new worker finishes the rest, each job once
    rows = service.wait_done("drain", service.worker("--max-jobs", "3"))
    assert all(r["status"] == "succeeded" for r in rows.values())
    assert set(service.results_per_job("drain").values()) == {1}


def test_cancel_takes_a_job_out_of_the_running_batch(database_url, tmp_path, request):
    service = Service(database_url, tmp_path, request)
    jobs = [{"custom_id": f"doc-{i}", "prompt": f"Essay {i}:", "params": {"max_new_tokens": 20 if i else 4000,
                                                                           "ignore_eos": True}}
            for i in range(4)]
    service.submit("cancel", jobs, "--max-new-tokens", "4000")
    worker = service.worker("--max-jobs", "4", BATCHD_CANCEL_POLL_S="0.2")
    wait_for(lambda: service.rows("cancel")["doc-0"]["status"] == "running", 240, "the long job to start", worker=worker)
    [job_id] = [r["job_id"] for r in service.query(
        "SELECT j.id AS job_id FROM jobs j WHERE j.custom_id = 'doc-0' AND j.status = 'running'")]
    out = batchd_cli(["cancel", str(job_id)], service.env)
    assert out.returncode == 0, out.stderr.decode()
    wait_for(lambda: f"job {job_id} is no longer ours" in worker.output(), 60, "the worker to drop the job",
             worker=worker)
    rows = service.wait_done("cancel", worker)
    assert worker.stop() == 0, worker.output()[-3000:]
    assert rows["doc-0"]["status"] == "cancelled" and rows["doc-0"]["output_sha256"] is None
    assert all(rows[f"doc-{i}"]["status"] == "succeeded" for i in (1, 2, 3))
    assert f"job {job_id} left the batch: cancelled" in worker.output()


def test_status_shows_jobs_in_flight_per_worker(database_url, tmp_path, request):
    service = Service(database_url, tmp_path, request)
    service.submit("shown", JOBS[:5])
    with db_engine(database_url).begin() as connection:
        ids = connection.execute(sa.text("SELECT id FROM jobs ORDER BY id")).scalars().all()
        for job_id, worker in zip(ids, ["gpu-a", "gpu-a", "gpu-a", "gpu-b"]):
            connection.execute(sa.text("UPDATE jobs SET status = 'running', worker_id = :w WHERE id = :j"),
                               {"w": worker, "j": job_id})
    out = batchd_cli(["status"], service.env)
    assert out.returncode == 0, out.stderr.decode()
    lines = out.stdout.decode().splitlines()
    assert "worker gpu-a: 3 jobs in flight" in lines and "worker gpu-b: 1 job in flight" in lines
