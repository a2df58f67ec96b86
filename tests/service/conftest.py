"""Fixtures for the service tests: real Redis, SQLite and PostgreSQL, and `batchd` processes.

- `database_url` runs a test on both databases: a fresh SQLite file, and a fresh schema of
  the PostgreSQL test database (reached through `search_path` in the URL, so a worker
  subprocess given the URL lands in the same schema). PostgreSQL at BATCHD_TEST_POSTGRES_URL,
  else postgresql://postgres@127.0.0.1:5432/test, else the same as user root (CI).
- `redis_url` is Redis db BATCHD_TEST_REDIS_DB (default 11) on 127.0.0.1:6379. Every test gets
  its own queue prefix and deletes only its own keys afterwards (never FLUSHDB: another test
  run on the same machine may be using the same database).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Optional

import pytest
import redis
import sqlalchemy as sa

from batchd.config import Settings
from batchd.db import migrate
from batchd.db.session import dispose_all
from tests.conftest import smollm2_gguf_path

REPO_ROOT = Path(__file__).resolve().parents[2]
REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
REDIS_DB = int(os.environ.get("BATCHD_TEST_REDIS_DB", "11"))
POSTGRES_CANDIDATES = [os.environ.get("BATCHD_TEST_POSTGRES_URL"), "postgresql://postgres@127.0.0.1:5432/test",
                       "postgresql://root@127.0.0.1:5432/test"]


def _reachable_postgres() -> Optional[str]:
    for url in filter(None, POSTGRES_CANDIDATES):
        try:
            engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg2://", 1))
            with engine.connect() as connection:
                connection.execute(sa.text("SELECT 1"))
            engine.dispose()
            return url
        except Exception:
            continue
    return None


@pytest.fixture(scope="session")
def postgres_base_url() -> str:
    url = _reachable_postgres()
    if url is None:
        pytest.fail(f"no PostgreSQL at any of {[u for u in POSTGRES_CANDIDATES if u]}")
    return url


def _schema_url(base: str, schema: str) -> str:
    return f"{base}?options=-csearch_path%3D{schema}"


def _make_database(kind: str, tmp_path: Path, request) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'batchd.db'}"
    base = request.getfixturevalue("postgres_base_url")
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(base.replace("postgresql://", "postgresql+psycopg2://", 1), isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(sa.text(f"CREATE SCHEMA {schema}"))

    def drop() -> None:
        dispose_all()
        with admin.connect() as connection:
            connection.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()

    request.addfinalizer(drop)
    return _schema_url(base, schema)


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_database_url(request, tmp_path) -> str:
    """A database with no tables (for migration tests)."""
    return _make_database(request.param, tmp_path, request)


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path) -> str:
    """A migrated database, SQLite and PostgreSQL."""
    url = _make_database(request.param, tmp_path, request)
    migrate.upgrade(url)
    yield url
    dispose_all()


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    url = f"sqlite:///{tmp_path / 'batchd.db'}"
    migrate.upgrade(url)
    yield url
    dispose_all()


def delete_queue_keys(url: str, prefix: str) -> None:
    """Remove the lists and kombu bindings of one test's queues, nothing else."""
    client = redis.Redis.from_url(url)
    for key in client.scan_iter(f"*{prefix}*"):
        client.delete(key)
    for tag, message in client.hscan_iter("unacked"):  # a killed worker's message, held for redelivery
        if prefix.encode() in message:
            client.hdel("unacked", tag)
            client.zrem("unacked_index", tag)
    client.close()


@pytest.fixture
def queue_prefix() -> str:
    return f"test{uuid.uuid4().hex[:8]}"


@pytest.fixture
def redis_url(queue_prefix) -> str:
    client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=REDIS_DB)
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.fail(f"no Redis at {REDIS_HOST}:{REDIS_PORT}")
    client.close()
    url = f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}"
    yield url
    delete_queue_keys(url, queue_prefix)


@pytest.fixture
def redis_client(redis_url) -> redis.Redis:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def service_env(database_url: str, broker_url: Optional[str], data_dir: Path, queue_prefix: str,
                **extra: str) -> dict[str, str]:
    """Environment for a `batchd` subprocess: everything through BATCHD_* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHD_")}
    env.update({
        "BATCHD_DATABASE_URL": database_url,
        "BATCHD_DATA_DIR": str(data_dir),
        "BATCHD_QUEUE_PREFIX": queue_prefix,
        "BATCHD_MODEL": str(smollm2_gguf_path()),
        "BATCHD_RELAY_INTERVAL_S": "0.5",
        "PYTHONUNBUFFERED": "1",
    })
    if broker_url:
        env["BATCHD_BROKER_URL"] = broker_url
    env.update(extra)
    return env


@pytest.fixture
def settings(database_url, redis_url, queue_prefix, tmp_path) -> Settings:
    return Settings.from_env(env={}, database_url=database_url, broker_url=redis_url, queue_prefix=queue_prefix,
                             data_dir=str(tmp_path / "data"), model_path=str(smollm2_gguf_path()),
                             lease_s="30", queue_lease_s="60")


def batchd_cli(args: list[str], env: dict[str, str], *, input: Optional[bytes] = None,
               timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `python -m batchd ARGS` the way a person would, and capture what it prints."""
    return subprocess.run([sys.executable, "-m", "batchd", *args], env=env, cwd=REPO_ROOT, input=input,
                          capture_output=True, timeout=timeout)


class WorkerProcess:
    """A real `batchd worker` subprocess (real engine, real broker, real database)."""

    def __init__(self, env: dict[str, str], log_path: Path, *args: str):
        self.log_path = log_path
        self.log = open(log_path, "ab")
        self.process = subprocess.Popen([sys.executable, "-m", "batchd", "-v", "worker", *args], env=env,
                                        cwd=REPO_ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)

    def alive(self) -> bool:
        return self.process.poll() is None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.alive():
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self, timeout: float = 60) -> int:
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()
        return self.process.returncode


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, *, worker: Optional[WorkerProcess] = None,
             poll_s: float = 0.25) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if worker is not None and not worker.alive():
            raise AssertionError(f"worker exited ({worker.process.returncode}) while waiting for {what}:\n"
                                 f"{worker.output()[-4000:]}")
        time.sleep(poll_s)
    tail = f"\nworker log:\n{worker.output()[-4000:]}" if worker is not None else ""
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{tail}")
