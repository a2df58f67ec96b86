"""SIGKILL a worker in the middle of a job, start another: every job is done exactly once.

The killed worker's job stays `running` until its lease runs out; the new worker's relay then
requeues and republishes it. Its original message (unacknowledged, acks late) would come back
after the Redis visibility timeout and find the job finished: a duplicate that does nothing.
"""
from __future__ import annotations

import json
import uuid

import pytest
import sqlalchemy as sa

from batchd.db import migrate
from batchd.db.session import db_engine, dispose_all
from tests.service.conftest import (REDIS_HOST, REDIS_PORT, WorkerProcess, batchd_cli, delete_queue_keys, service_env,
                                    wait_for)

pytestmark = pytest.mark.slow

KILL_REDIS_DB = 13


def job_states(url: str) -> dict[str, dict]:
    with db_engine(url).connect() as connection:
        rows = connection.execute(sa.text(
            "SELECT custom_id, status, attempts, worker_id FROM jobs ORDER BY id")).mappings()
        return {r["custom_id"]: dict(r) for r in rows}


def test_sigkill_mid_job_then_new_worker_finishes_every_job_once(database_url, tmp_path, request):
    migrate.upgrade(database_url)
    broker_url = f"redis://{REDIS_HOST}:{REDIS_PORT}/{KILL_REDIS_DB}"
    prefix = f"kill{uuid.uuid4().hex[:8]}"
    env = service_env(database_url, broker_url, tmp_path / "data", prefix, BATCHD_LEASE_S="3")
    request.addfinalizer(lambda: delete_queue_keys(broker_url, prefix))
    jobs = "\n".join(json.dumps({"custom_id": f"doc-{i}", "prompt": f"Count from {i} to twenty:"}) for i in range(3))
    out = batchd_cli(["submit", "-", "--batch", "kill", "--max-new-tokens", "12"], env, input=jobs.encode())
    assert out.returncode == 0, out.stderr.decode()

    first = WorkerProcess(env, tmp_path / "first.log")
    try:
        wait_for(lambda: any(j["status"] == "running" for j in job_states(database_url).values()), 240,
                 "the first worker to start a job", worker=first)
    finally:
        first.kill()  # SIGKILL: no warm shutdown, no ack, no cleanup
    [victim] = [cid for cid, j in job_states(database_url).items() if j["status"] == "running"]

    second = WorkerProcess(env, tmp_path / "second.log")
    try:
        wait_for(lambda: all(j["status"] == "succeeded" for j in job_states(database_url).values()), 300,
                 "every job to succeed", worker=second)
    finally:
        assert second.stop() == 0, second.output()[-3000:]

    states = job_states(database_url)
    assert states[victim]["attempts"] == 2 and states[victim]["worker_id"] is not None
    with db_engine(database_url).connect() as connection:
        per_job = connection.execute(sa.text(
            "SELECT j.custom_id, COUNT(r.job_id) AS n FROM jobs j LEFT JOIN results r ON r.job_id = j.id "
            "GROUP BY j.custom_id")).all()
        victim_events = connection.execute(sa.text(
            "SELECT e.event FROM job_events e JOIN jobs j ON j.id = e.job_id WHERE j.custom_id = :c ORDER BY e.id"),
            {"c": victim}).scalars().all()
    assert dict(per_job) == {"doc-0": 1, "doc-1": 1, "doc-2": 1}
    assert victim_events[:3] == ["submitted", "running", "requeued"]
    assert victim_events.count("succeeded") == 1
    dispose_all()
