"""A real `batchd worker` process (real SmolLM2-135M engine on the CPU, real Redis) serving
jobs submitted by the CLI and by SQL INSERT, on SQLite and on PostgreSQL; bad inputs fail
one by one with a clear error while the rest of the batch succeeds."""
from __future__ import annotations

import hashlib
import json
import socket
import uuid

import pytest
import sqlalchemy as sa

from batchd.db import migrate
from batchd.db.session import db_engine, dispose_all
from tests.service.conftest import (REDIS_HOST, REDIS_PORT, WorkerProcess, _make_database, batchd_cli,
                                    delete_queue_keys, service_env, wait_for)

pytestmark = pytest.mark.slow

SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
LIVE_REDIS_DB = 12
JOB_TIMEOUT_S = 240


class LiveService:
    def __init__(self, database_url: str, env: dict, worker: WorkerProcess, tmp):
        self.database_url, self.env, self.worker, self.tmp = database_url, env, worker, tmp

    def query(self, sql: str, **params) -> list[dict]:
        with db_engine(self.database_url).connect() as connection:
            return [dict(r) for r in connection.execute(sa.text(sql), params).mappings()]

    def batch_rows(self, batch: str) -> dict[str, dict]:
        return {r["custom_id"]: r for r in self.query("SELECT * FROM job_results WHERE batch = :b", b=batch)}

    def wait_batch_done(self, batch: str, expected_jobs: int) -> dict[str, dict]:
        def done() -> bool:
            rows = self.batch_rows(batch)
            return len(rows) == expected_jobs and all(
                r["status"] in ("succeeded", "failed", "cancelled", "expired") for r in rows.values())
        wait_for(done, JOB_TIMEOUT_S, f"batch {batch} to finish", worker=self.worker)
        return self.batch_rows(batch)

    def cli(self, *args: str, input: bytes | None = None):
        return batchd_cli(list(args), self.env, input=input)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def live(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("live")
    database_url = _make_database(request.param, tmp, request)
    migrate.upgrade(database_url)
    broker_url = f"redis://{REDIS_HOST}:{REDIS_PORT}/{LIVE_REDIS_DB}"
    prefix = f"live{uuid.uuid4().hex[:8]}"
    env = service_env(database_url, broker_url, tmp / "data", prefix, BATCHD_LEASE_S="10")
    worker = WorkerProcess(env, tmp / "worker.log")
    yield LiveService(database_url, env, worker, tmp)
    code = worker.stop()
    dispose_all()
    delete_queue_keys(broker_url, prefix)
    assert code == 0, worker.output()[-3000:]


def test_cli_jobs_store_output_sha_and_telemetry(live):
    jobs = "\n".join(json.dumps(j) for j in [
        {"custom_id": "capital", "prompt": "The capital of France is"},
        {"custom_id": "chat", "messages": [{"role": "user", "content": "Say hello."}], "params": {"chat": True}},
    ]).encode()
    submitted = live.cli("submit", "-", "--batch", "cli", "--max-new-tokens", "5", input=jobs)
    assert submitted.returncode == 0, submitted.stderr.decode()
    rows = live.wait_batch_done("cli", 2)
    for row in rows.values():
        assert row["status"] == "succeeded", row
        assert row["output_sha256"] == hashlib.sha256(row["output_text"].encode("utf-8")).hexdigest()
        assert row["generated_tokens"] == 5 or row["finish_reason"] in ("eos", "stop")
        assert 0 < row["generated_tokens"] <= 5 and row["prompt_tokens"] > 0
        assert row["effective_prompt_tokens"] == row["prompt_tokens"]
        assert row["target_sha256"] == SMOLLM2_SHA256 and row["dtype"] == "float32"
        assert row["prefill_s"] > 0 and row["decode_s"] > 0 and row["total_s"] >= row["prefill_s"]
        # the first token comes from the prefill: a one-token answer has no decode steps to rate
        assert (row["decode_tokens_per_s"] > 0) == (row["generated_tokens"] > 1)
        assert row["queue_wait_s"] is not None and row["queue_wait_s"] >= 0
        assert row["worker_host"] == socket.gethostname() and row["device"] == "cpu"
        assert row["spec_method"] == "none" and row["attempts"] == 1
    assert " Paris" in rows["capital"]["output_text"]

    exported = live.cli("export", "--batch", "cli")
    lines = [json.loads(line) for line in exported.stdout.decode().splitlines()]
    assert {line["custom_id"] for line in lines} == {"capital", "chat"}
    assert all(line["output_sha256"] and "decode_tokens_per_s" in line for line in lines)
    table = live.cli("results", "--batch", "cli").stdout.decode()
    assert rows["capital"]["output_sha256"][:16] in table
    status = live.cli("status", "--batch", "cli", "--no-watch").stdout.decode()
    assert "2/2" in status and "succeeded 2" in status


def test_resubmitting_a_batch_adds_nothing(live):
    jobs = json.dumps({"custom_id": "once", "prompt": "One, two,"}).encode()
    for _ in range(2):
        out = live.cli("submit", "-", "--batch", "idem", "--max-new-tokens", "2", input=jobs)
        assert out.returncode == 0, out.stderr.decode()
    assert "1 already in the batch" in out.stdout.decode()
    rows = live.wait_batch_done("idem", 1)
    assert rows["once"]["status"] == "succeeded"


def test_sql_insert_is_picked_up_by_the_relay(live):
    with db_engine(live.database_url).begin() as connection:
        connection.execute(sa.text("INSERT INTO batches (name) VALUES ('from-sql')"))
        connection.execute(sa.text(
            "INSERT INTO jobs (batch_id, custom_id, prompt, params) "
            "SELECT id, 'sql-1', 'The opposite of hot is', '{\"max_new_tokens\": 4}' FROM batches WHERE name = 'from-sql'"))
    rows = live.wait_batch_done("from-sql", 1)
    row = rows["sql-1"]
    assert row["status"] == "succeeded" and row["model"] == "smollm2-135m"
    assert 0 < row["generated_tokens"] <= 4 and row["max_new_tokens"] == 4


def test_bad_inputs_fail_one_by_one_and_the_rest_succeed(live):
    docs = live.tmp / "bad-docs"
    docs.mkdir()
    (docs / "good.txt").write_text("The capital of Italy is")
    (docs / "empty.txt").write_bytes(b"")
    (docs / "binary.bin").write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\x00")
    (docs / "latin1.txt").write_bytes("Ca\xf1on".encode("latin-1"))
    (docs / "too-long.txt").write_text("lorem ipsum dolor sit amet " * 2000)  # > 8K tokens, no compression
    jsonl = live.tmp / "bad.jsonl"
    jsonl.write_text("\n".join([
        json.dumps({"custom_id": "good-line", "prompt": "Water boils at"}),
        "{this is not json",
        json.dumps({"custom_id": "good-line", "prompt": "a duplicate custom_id"}),
        json.dumps({"custom_id": "negative", "prompt": "x", "params": {"max_new_tokens": -4}}),
        json.dumps({"custom_id": "cold", "prompt": "x", "params": {"temperature": -1}}),
        json.dumps({"custom_id": "nucleus", "prompt": "x", "params": {"top_p": 1.5}}),
        json.dumps({"custom_id": "unknown-key", "prompt": "x", "params": {"max_tokens": 4}}),
        json.dumps({"custom_id": "model-path", "prompt": "x", "model": "/models/missing.gguf"}),
        json.dumps({"custom_id": "drafter", "prompt": "x", "params": {"spec": "draft", "drafter": "/nope.gguf"}}),
    ]))
    out = live.cli("submit", str(docs), str(jsonl), "--batch", "bad", "--max-new-tokens", "3")
    assert out.returncode == 0, out.stderr.decode()
    stderr = out.stderr.decode()
    assert "duplicate custom_id 'good-line'" in stderr and "Traceback" not in stderr
    # a row written by SQL skips submit's checks; the worker checks it again
    with db_engine(live.database_url).begin() as connection:
        connection.execute(sa.text(
            "INSERT INTO jobs (batch_id, custom_id, prompt, params) SELECT id, 'sql-bad', 'x', "
            "'{\"max_new_tokens\": 0}' FROM batches WHERE name = 'bad'"))
        connection.execute(sa.text(
            "INSERT INTO jobs (batch_id, custom_id, prompt) SELECT id, 'sql-empty', '   ' FROM batches WHERE name = 'bad'"))
    rows = live.wait_batch_done("bad", 15)
    ids = {name: f"{docs}/{name}" for name in ("good.txt", "empty.txt", "binary.bin", "latin1.txt", "too-long.txt")}
    assert rows[ids["good.txt"]]["status"] == "succeeded"
    assert rows["good-line"]["status"] == "succeeded"
    expected = {
        ids["empty.txt"]: ("bad_input", "empty file"),
        ids["binary.bin"]: ("bad_input", "binary file"),
        ids["latin1.txt"]: ("bad_input", "not valid UTF-8"),
        ids["too-long.txt"]: ("too_long", "context"),
        f"{jsonl}:2": ("bad_input", "not valid JSON"),
        "negative": ("bad_input", "max_new_tokens"),
        "cold": ("bad_input", "temperature"),
        "nucleus": ("bad_input", "top_p"),
        "unknown-key": ("bad_input", "unknown param 'max_tokens'"),
        "model-path": ("bad_input", "unknown model '/models/missing.gguf'"),
        "drafter": ("bad_input", "not a drafter name"),
        "sql-bad": ("bad_input", "max_new_tokens"),
        "sql-empty": ("bad_input", "empty"),
    }
    for custom_id, (kind, words) in expected.items():
        row = rows[custom_id]
        assert row["status"] == "failed" and row["error_kind"] == kind, (custom_id, row["error_kind"], row["error_message"])
        assert words in row["error_message"], (custom_id, row["error_message"])
    assert rows[ids["too-long.txt"]]["retryable"] in (False, 0)


def test_the_worker_keeps_a_heartbeat_for_its_model(live):
    """What `batchd status` reads to tell jobs that no worker serves (batchd.jobs.heartbeat)."""
    wait_for(lambda: live.query("SELECT model FROM workers"), JOB_TIMEOUT_S, "the worker's row", worker=live.worker)
    [row] = live.query("SELECT model, host, started_at, last_seen_at FROM workers")
    assert row["model"] == "smollm2-135m" and row["host"] == socket.gethostname()
