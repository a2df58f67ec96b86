"""What the service adds to each job, and how fast it takes a batch in.

For the embedded defaults (SQLite + embedded valkey) and for Redis + PostgreSQL:
- submit throughput: 10,000 JSONL jobs written and published, in process (`submit_jobs`, the
  code path of `batchd submit`) and through the `batchd submit` command (process start included);
- added latency per job, with a real `batchd worker` (SmolLM2-135M on the CPU, one new token):
  submit -> worker start (the claim), worker start -> engine start, engine end -> committed
  result (seen by a reader polling every millisecond), median over jobs submitted one at a
  time to an idle worker; "added" is their sum: the job's wall time minus the engine's. The
  JSON line also gives `submit_call_ms`, the part of submit -> start spent in `submit_jobs`
  (the rest is Redis and Celery delivering the message to the worker).
It measures the service, not the model: run it on the CPU.

    python bench/service_overhead.py [--jobs 10000] [--latency-jobs 30] [--only embedded|postgres]
        [--postgres-url postgresql://postgres@127.0.0.1:5432/test] [--redis-url redis://127.0.0.1:6379/14]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis
import sqlalchemy as sa

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from batchd.config import Settings  # noqa: E402
from batchd.db import migrate  # noqa: E402
from batchd.db.session import db_engine, dispose_all  # noqa: E402
from batchd.embedded import EmbeddedBroker  # noqa: E402
from batchd.jobs.inputs import JobInput, read_inputs  # noqa: E402
from batchd.jobs.publish import Publisher  # noqa: E402
from batchd.jobs.submit import submit_jobs  # noqa: E402
from batchd.queue.celery_app import configure  # noqa: E402
from batchd.db.types import utcnow  # noqa: E402

THROUGHPUT_MODEL = "bench-throughput"  # no worker serves it: published messages just wait


def write_jsonl(path: Path, n: int) -> None:
    with path.open("w") as out:
        for i in range(n):
            out.write(json.dumps({"custom_id": f"doc-{i:05d}", "prompt": f"Summarise document {i}.",
                                  "params": {"max_new_tokens": 64}}) + "\n")


def measure_submit(settings: Settings, jsonl: Path, env: dict) -> dict:
    publisher = Publisher(settings, configure(settings, settings.broker_url))
    started = time.perf_counter()
    report = submit_jobs(settings, "throughput", read_inputs([str(jsonl)]), model=THROUGHPUT_MODEL,
                         publisher=publisher)
    in_process = time.perf_counter() - started
    assert report.published == len(report.job_ids)
    started = time.perf_counter()
    cli = subprocess.run([sys.executable, "-m", "batchd", "submit", str(jsonl), "--batch", "throughput-cli",
                          "--job-model", THROUGHPUT_MODEL], env=env, cwd=REPO_ROOT, capture_output=True, text=True)
    by_cli = time.perf_counter() - started
    if cli.returncode != 0:
        raise RuntimeError(cli.stderr)
    queued = publisher.queue_length(THROUGHPUT_MODEL)
    return {"jobs": len(report.job_ids), "in_process_s": in_process, "cli_s": by_cli, "queued_messages": queued}


def measure_latency(settings: Settings, env: dict, n: int, log_path: Path) -> dict:
    worker = subprocess.Popen([sys.executable, "-m", "batchd", "worker", "--no-relay", "--loglevel", "WARNING"],
                              env=env, cwd=REPO_ROOT, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    try:
        publisher = Publisher(settings, configure(settings, settings.broker_url))
        job = lambda i: JobInput(custom_id=f"lat-{i}", source="bench", prompt="The capital of France is",  # noqa: E731
                                 params={"max_new_tokens": 1})
        wait_done(settings, submit_jobs(settings, "warmup", [job(-1)], publisher=publisher).job_ids[0], worker, 600)
        marks = {}  # job id -> wall clock before submit, after submit returned, when the committed result was seen
        for i in range(n):
            submitted = utcnow()
            [job_id] = submit_jobs(settings, "latency", [job(i)], publisher=publisher).job_ids
            sent = utcnow()
            wait_done(settings, job_id, worker, 120)
            marks[job_id] = (submitted, sent, utcnow())
    finally:
        worker.terminate()
        worker.wait(timeout=120)
    with db_engine(settings.database_url).connect() as connection:
        rows = connection.execute(sa.text(
            "SELECT job_id, running_at, engine_started_at, engine_finished_at "
            "FROM job_results WHERE batch = 'latency' AND status = 'succeeded'")).all()
    ms = lambda a, b: (_ts(b) - _ts(a)).total_seconds() * 1000  # noqa: E731
    to_start = [ms(marks[r.job_id][0], r.running_at) for r in rows]
    submit_call = [ms(marks[r.job_id][0], marks[r.job_id][1]) for r in rows]
    to_engine = [ms(r.running_at, r.engine_started_at) for r in rows]
    to_commit = [ms(r.engine_finished_at, marks[r.job_id][2]) for r in rows]
    added = sorted(a + b + c for a, b, c in zip(to_start, to_engine, to_commit))
    return {"jobs": len(rows), "submit_to_start_ms": statistics.median(to_start),
            "submit_call_ms": statistics.median(submit_call),
            "start_to_engine_ms": statistics.median(to_engine), "engine_end_to_commit_ms": statistics.median(to_commit),
            "added_ms": statistics.median(added), "p90_added_ms": added[int(0.9 * (len(added) - 1))]}


def _ts(value):
    from batchd.db.types import UTCDateTime

    if isinstance(value, str):
        from datetime import datetime
        value = datetime.fromisoformat(value)
    return UTCDateTime().process_result_value(value, None)


def wait_done(settings: Settings, job_id: int, worker: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with db_engine(settings.database_url).execution_options(batchd_read_only=True).connect() as connection:
        while time.monotonic() < deadline:
            status = connection.execute(sa.text("SELECT status FROM jobs WHERE id = :i"), {"i": job_id}).scalar()
            connection.rollback()
            if status in ("succeeded", "failed"):
                if status == "failed":
                    raise RuntimeError(f"job {job_id} failed")
                return
            if worker.poll() is not None:
                raise RuntimeError("the worker exited")
            time.sleep(0.001)
    raise TimeoutError(f"job {job_id} did not finish in {timeout} s")


def run_setup(label: str, database_url: str, broker_url: str | None, data_dir: Path, args) -> dict:
    prefix = f"bench{uuid.uuid4().hex[:6]}"
    data_dir.mkdir(parents=True, exist_ok=True)
    broker = None
    if broker_url is None:
        broker = EmbeddedBroker(data_dir)
        broker_url = broker.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHD_")}
    env.update(BATCHD_DATABASE_URL=database_url, BATCHD_BROKER_URL=broker_url, BATCHD_DATA_DIR=str(data_dir),
               BATCHD_QUEUE_PREFIX=prefix)
    settings = Settings.from_env(env=env)
    migrate.upgrade(database_url)
    jsonl = data_dir / "jobs.jsonl"
    write_jsonl(jsonl, args.jobs)
    try:
        submit = measure_submit(settings, jsonl, env)
        latency = measure_latency(settings, env, args.latency_jobs, data_dir / "worker.log")
    finally:
        client = redis.Redis.from_url(broker_url)
        for key in client.scan_iter(f"*{prefix}*"):  # its queues and their kombu bindings
            client.delete(key)
        if broker is not None:
            broker.stop()
        dispose_all()
    result = {"setup": label, **{f"submit_{k}": v for k, v in submit.items()}, **latency}
    print(json.dumps(result), flush=True)
    return result


def postgres_schema_url(base: str) -> tuple[str, callable]:
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(base.replace("postgresql://", "postgresql+psycopg2://", 1), isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(sa.text(f"CREATE SCHEMA {schema}"))

    def drop():
        with admin.connect() as connection:
            connection.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
    return f"{base}?options=-csearch_path%3D{schema}", drop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--latency-jobs", type=int, default=30)
    parser.add_argument("--only", choices=["embedded", "postgres"])
    parser.add_argument("--postgres-url", default=os.environ.get("BATCHD_BENCH_POSTGRES_URL",
                                                                 "postgresql://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--redis-url", default=os.environ.get("BATCHD_BENCH_REDIS_URL", "redis://127.0.0.1:6379/14"))
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="batchd-bench-") as tmp:
        if args.only in (None, "embedded"):
            data_dir = Path(tmp) / "embedded"
            results.append(run_setup("embedded (SQLite + valkey)", f"sqlite:///{data_dir / 'batchd.db'}", None,
                                     data_dir, args))
        if args.only in (None, "postgres"):
            url, drop = postgres_schema_url(args.postgres_url)
            try:
                results.append(run_setup("PostgreSQL + Redis", url, args.redis_url, Path(tmp) / "pg", args))
            finally:
                drop()
    print_table(results, args)


def print_table(results: list[dict], args) -> None:
    print(f"\nservice overhead: {args.jobs} jobs submitted; latency = median over {args.latency_jobs} jobs "
          "submitted one at a time to an idle worker (SmolLM2-135M, CPU, 1 new token)\n")
    print(f"{'setup':<28} {'submit s':>9} {'jobs/s':>8} {'CLI s':>7} {'submit->start':>14} {'start->engine':>14} "
          f"{'engine->commit':>15} {'added ms':>9} {'p90':>7}")
    for r in results:
        print(f"{r['setup']:<28} {r['submit_in_process_s']:>9.2f} {r['submit_jobs'] / r['submit_in_process_s']:>8.0f} "
              f"{r['submit_cli_s']:>7.2f} {r['submit_to_start_ms']:>12.1f}ms {r['start_to_engine_ms']:>12.1f}ms "
              f"{r['engine_end_to_commit_ms']:>13.1f}ms {r['added_ms']:>9.1f} {r['p90_added_ms']:>7.1f}")
    print("\ntargets: < 20 ms added per job; 10,000 jobs submitted in < 5 s")


if __name__ == "__main__":
    main()
