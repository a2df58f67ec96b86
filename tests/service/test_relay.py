"""The relay against real Redis on both databases: SQL-inserted jobs get published, a dead
worker's job is requeued when its lease expires, lost messages are sent again, deadlines expire."""
from __future__ import annotations

import json
import time
from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy import select

from batchd.db.models import Job, JobEvent, JobStatus
from batchd.db.session import session_scope
from batchd.db.types import utcnow
from batchd.jobs import lifecycle
from batchd.jobs.inputs import JobInput
from batchd.jobs.publish import Publisher
from batchd.jobs.submit import submit_jobs
from batchd.queue.celery_app import configure
from batchd.relay import Relay


def job_ids_in_queue(redis_client, queue: str) -> list[int]:
    """Job ids of the Celery messages waiting in a queue (oldest first)."""
    ids = []
    for raw in reversed(redis_client.lrange(queue, 0, -1)):
        message = json.loads(raw)
        assert message["content-type"] == "application/json"  # JSON only, never pickle
        assert message["headers"]["task"] == "batchd.run_job"
        ids.append(message["headers"]["argsrepr"] and int(message["headers"]["argsrepr"].strip("[](),")))
    return ids


def make_relay(settings):
    publisher = Publisher(settings, configure(settings, settings.broker_url))
    return Relay(settings, publisher), publisher


def insert_by_sql(settings, batch="sql-batch", n=2) -> list[int]:
    """The README's recipe: a batch row, then job rows with only batch, custom_id and prompt."""
    with session_scope(settings.database_url) as session:
        session.execute(sa.text("INSERT INTO batches (name) VALUES (:name)"), {"name": batch})
        for i in range(n):
            session.execute(sa.text(
                "INSERT INTO jobs (batch_id, custom_id, prompt, params) "
                "SELECT id, :cid, :prompt, :params FROM batches WHERE name = :name"),
                {"cid": f"sql-{i}", "prompt": f"text {i}", "params": '{"max_new_tokens": 8}', "name": batch})
        return list(session.scalars(select(Job.id).join(Job.batch).order_by(Job.id)))


def test_sql_inserted_jobs_are_published_once(settings, redis_client):
    ids = insert_by_sql(settings)
    relay, _ = make_relay(settings)
    report = relay.run_once()
    assert report.published == 2
    assert job_ids_in_queue(redis_client, settings.queue_name) == ids
    with session_scope(settings.database_url) as session:
        jobs = list(session.scalars(select(Job).order_by(Job.id)))
    assert all(j.status == JobStatus.QUEUED and j.model == settings.model_name and j.queued_at for j in jobs)
    assert relay.run_once().published == 0  # nothing twice


def test_submit_publishes_after_commit_in_bulk(settings, redis_client):
    publisher = Publisher(settings, configure(settings, settings.broker_url))
    jobs = [JobInput(custom_id=f"c{i}", source="t", prompt="p") for i in range(250)]
    report = submit_jobs(settings, "bulk", jobs, publisher=publisher)
    assert report.published == 250
    assert job_ids_in_queue(redis_client, settings.queue_name) == report.job_ids


def test_expired_lease_of_a_running_job_requeues_and_republishes(settings, redis_client):
    [job_id] = submit_jobs(settings, "b", [JobInput(custom_id="x", source="t", prompt="p")]).job_ids
    relay, _ = make_relay(settings)
    relay.run_once()
    redis_client.delete(settings.queue_name)  # the worker took the message ...
    assert lifecycle.claim(settings.database_url, job_id, "dead-worker", lease_s=0.001)  # ... and died
    time.sleep(0.01)
    assert relay.run_once().requeued == 1
    requeued = session_get(settings, job_id)
    assert requeued.status == JobStatus.QUEUED and requeued.worker_id is None and requeued.attempts == 1
    assert job_ids_in_queue(redis_client, settings.queue_name) == [job_id]
    assert "requeued" in events(settings, job_id)


def test_worker_lost_too_often_fails_the_job(settings, redis_client):
    [job_id] = submit_jobs(settings, "b", [JobInput(custom_id="x", source="t", prompt="p")]).job_ids
    relay, _ = make_relay(settings)
    for attempt in range(settings.max_attempts):
        relay.run_once()
        assert lifecycle.claim(settings.database_url, job_id, f"w{attempt}", lease_s=0.001)
        time.sleep(0.01)
    report = relay.run_once()
    assert report.lost == 1
    lost = session_get(settings, job_id)
    assert lost.status == JobStatus.FAILED and lost.error_kind == "worker_lost" and lost.retryable


def test_lost_messages_are_republished_up_to_the_deficit(settings, redis_client):
    ids = submit_jobs(settings, "b", [JobInput(custom_id=f"x{i}", source="t", prompt="p") for i in range(3)]).job_ids
    relay, _ = make_relay(settings)
    relay.run_once()
    redis_client.rpop(settings.queue_name)  # the oldest message is lost (e.g. a broker restart)
    assert relay.run_once().republished == 0  # queue leases not expired yet
    with session_scope(settings.database_url) as session:
        session.execute(sa.update(Job).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
    assert relay.run_once().republished == 1  # 3 queued, 2 messages: one sent again
    assert sorted(job_ids_in_queue(redis_client, settings.queue_name)) == sorted(ids)
    assert relay.run_once().republished == 0


def test_deadline_expires_waiting_jobs(settings, redis_client):
    [job_id] = submit_jobs(settings, "b", [JobInput(custom_id="x", source="t", prompt="p")],
                           expires_in_s=0.001).job_ids
    relay, _ = make_relay(settings)
    assert relay.run_once().expired == 1
    assert session_get(settings, job_id).status == JobStatus.EXPIRED


def session_get(settings, job_id) -> Job:
    with session_scope(settings.database_url) as session:
        return session.get(Job, job_id)


def events(settings, job_id) -> list[str]:
    with session_scope(settings.database_url) as session:
        return list(session.scalars(select(JobEvent.event).where(JobEvent.job_id == job_id).order_by(JobEvent.id)))
