"""Jobs that would wait for ever: a model no worker serves is named by `batchd status` (and its
jobs expire at their deadline), and a row inserted as `queued` by SQL is published after all.
Real Redis, SQLite and PostgreSQL."""
from __future__ import annotations

from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy import select, update

from batchd.db.models import Job, JobEvent, JobStatus, Worker
from batchd.db.session import session_scope
from batchd.db.types import utcnow
from batchd.jobs import heartbeat
from batchd.jobs.inputs import JobInput
from batchd.jobs.submit import submit_jobs
from tests.service.conftest import batchd_cli, service_env
from tests.service.test_relay import job_ids_in_queue, make_relay

UNSERVED_AFTER_S = 600


def submit_waiting(settings, batch: str, model: str, n: int, waited_s: float, expires_in_s=None) -> list[int]:
    """`n` pending jobs of `model` that have waited `waited_s` already."""
    report = submit_jobs(settings, batch, [JobInput(custom_id=f"{model}-{i}", source="test", prompt=f"text {i}") for i in range(n)],
                         model=model, expires_in_s=expires_in_s)
    with session_scope(settings.database_url) as session:
        session.execute(update(Job).where(Job.id.in_(report.job_ids))
                        .values(pending_at=utcnow() - timedelta(seconds=waited_s)))
    return report.job_ids


def seen(settings, worker_id: str, model: str, ago_s: float) -> None:
    heartbeat.register_worker(settings.database_url, worker_id, model)
    with session_scope(settings.database_url) as session:
        session.execute(update(Worker).where(Worker.worker_id == worker_id)
                        .values(last_seen_at=utcnow() - timedelta(seconds=ago_s)))


def unserved(settings, batch_id: int) -> dict[str, int]:
    return {m.model: m.waiting for m in heartbeat.unserved_models(settings.database_url, batch_id, settings.model_name,
                                                                  UNSERVED_AFTER_S)}


def test_status_names_the_jobs_whose_model_no_worker_serves(settings, redis_url, queue_prefix, tmp_path):
    [lost, *_] = submit_waiting(settings, "mixed", "llama-70b", 3, waited_s=2 * UNSERVED_AFTER_S)
    submit_waiting(settings, "mixed", settings.model_name, 2, waited_s=2 * UNSERVED_AFTER_S)
    submit_waiting(settings, "mixed", "qwen-7b", 1, waited_s=10)   # has not waited long enough to say so
    seen(settings, "served@host:1", settings.model_name, ago_s=5)
    with session_scope(settings.database_url) as session:
        batch_id = session.scalar(select(Job.batch_id).where(Job.id == lost))

    env = service_env(settings.database_url, redis_url, tmp_path / "data", queue_prefix,
                      BATCHD_UNSERVED_AFTER_S=str(UNSERVED_AFTER_S))
    out = batchd_cli(["status", "--batch", "mixed", "--no-watch"], env)
    assert out.returncode == 0, out.stderr.decode()
    lines = out.stdout.decode().splitlines()
    assert len(lines) == 2, lines
    assert "3 jobs wait for model llama-70b, which no worker serves (no worker has served it" in lines[1]
    assert "they have no deadline" in lines[1] and "--model-name llama-70b" in lines[1]

    seen(settings, "gone@host:2", "llama-70b", ago_s=2 * UNSERVED_AFTER_S)   # a worker that stopped long ago
    [model] = heartbeat.unserved_models(settings.database_url, batch_id, settings.model_name, UNSERVED_AFTER_S)
    assert (model.model, model.waiting) == ("llama-70b", 3)
    assert "its last worker was seen" in model.line()
    seen(settings, "back@host:3", "llama-70b", ago_s=5)   # a live one: nothing to say
    assert unserved(settings, batch_id) == {}


def test_a_pending_row_without_a_model_waits_for_the_default_model(settings):
    with session_scope(settings.database_url) as session:
        session.execute(sa.text("INSERT INTO batches (name) VALUES ('sql')"))
        session.execute(sa.text("INSERT INTO jobs (batch_id, custom_id, prompt, pending_at) "
                                "SELECT id, 'a', 'text', :ago FROM batches WHERE name = 'sql'"),
                        {"ago": utcnow() - timedelta(seconds=2 * UNSERVED_AFTER_S)})
        batch_id = session.scalar(select(Job.batch_id))
    assert unserved(settings, batch_id) == {settings.model_name: 1}
    seen(settings, "served@host:1", settings.model_name, ago_s=1)
    assert unserved(settings, batch_id) == {}


def test_jobs_of_a_model_no_worker_serves_expire_at_their_deadline(settings, redis_client):
    ids = submit_waiting(settings, "nobody", "llama-70b", 2, waited_s=2 * UNSERVED_AFTER_S, expires_in_s=3600)
    relay, _ = make_relay(settings)
    relay.run_once()
    [model] = heartbeat.unserved_models(settings.database_url, _batch_of(settings, ids[0]), settings.model_name,
                                        UNSERVED_AFTER_S)
    assert "they expire by" in model.line()
    with session_scope(settings.database_url) as session:   # the deadline passes
        session.execute(update(Job).where(Job.id.in_(ids)).values(expires_at=utcnow() - timedelta(seconds=1)))
    assert redis_client.llen(f"{settings.queue_prefix}.llama-70b") == 2   # published, and nobody draws them
    assert relay.run_once().expired == 2
    with session_scope(settings.database_url) as session:
        assert set(session.scalars(select(Job.status).where(Job.id.in_(ids)))) == {JobStatus.EXPIRED}
    assert redis_client.llen(f"{settings.queue_prefix}.llama-70b") == 0   # their messages went with them


def _batch_of(settings, job_id: int) -> int:
    with session_scope(settings.database_url) as session:
        return session.scalar(select(Job.batch_id).where(Job.id == job_id))


def test_a_row_inserted_as_queued_by_sql_is_published(settings, redis_client):
    with session_scope(settings.database_url) as session:
        session.execute(sa.text("INSERT INTO batches (name) VALUES ('sql-queued')"))
        session.execute(sa.text("INSERT INTO jobs (batch_id, custom_id, prompt, status, queued_at) "
                                "SELECT id, 'q', 'text', 'queued', :now FROM batches WHERE name = 'sql-queued'"),
                        {"now": utcnow()})
        [job_id] = session.scalars(select(Job.id))
    relay, _ = make_relay(settings)
    assert relay.run_once().published == 1
    assert job_ids_in_queue(redis_client, settings.queue_name) == [job_id]
    with session_scope(settings.database_url) as session:
        job = session.get(Job, job_id)
        assert job.status == JobStatus.QUEUED and job.lease_expires_at is not None
        assert job.model == settings.model_name
        events = list(session.scalars(select(JobEvent.event).where(JobEvent.job_id == job_id).order_by(JobEvent.id)))
    assert events == ["pending", "queued"]
    assert relay.run_once().published == 0   # published once, and a published job is left alone
    assert job_ids_in_queue(redis_client, settings.queue_name) == [job_id]
