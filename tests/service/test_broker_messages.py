"""The broker's queues agree with the record: a broker that lost everything gets every queued
job again at once (not after the queue lease), and cancelled jobs leave no messages behind.
Real Redis, SQLite and PostgreSQL."""
from __future__ import annotations

from sqlalchemy import select

from batchd.db.models import Job, JobEvent, JobStatus
from batchd.db.session import session_scope
from batchd.jobs.inputs import JobInput
from batchd.jobs.submit import submit_jobs
from tests.service.conftest import batchd_cli, service_env
from tests.service.test_relay import job_ids_in_queue, make_relay


def submit_published(settings, batch: str, n: int) -> list[int]:
    relay, publisher = make_relay(settings)
    jobs = [JobInput(custom_id=f"{batch}-{i}", source="t", prompt=f"text {i}") for i in range(n)]
    return submit_jobs(settings, batch, jobs, publisher=publisher).job_ids


def test_a_broker_that_lost_everything_gets_every_queued_job_again_at_once(settings, redis_client):
    ids = submit_published(settings, "b", 3)
    relay, publisher = make_relay(settings)
    assert relay.run_once().republished == 0    # the queue is whole; the relay leaves its mark
    assert redis_client.exists(publisher.broker_mark_key)
    redis_client.delete(settings.queue_name, publisher.broker_mark_key)   # restarted empty
    report = relay.run_once()
    assert report.republished == 3             # queue leases (60 s here) are far from expired
    assert sorted(job_ids_in_queue(redis_client, settings.queue_name)) == ids
    with session_scope(settings.database_url) as session:
        details = set(session.scalars(select(JobEvent.detail).where(JobEvent.event == "republished")))
    assert details == {"the broker lost its messages (it restarted empty or was flushed)"}
    assert relay.run_once().republished == 0   # once


def test_a_broker_that_kept_its_data_waits_for_the_queue_lease(settings, redis_client):
    submit_published(settings, "b", 3)
    relay, _ = make_relay(settings)
    relay.run_once()
    redis_client.rpop(settings.queue_name)     # one message lost, the broker's mark kept
    assert relay.run_once().republished == 0


def test_cancel_removes_the_cancelled_jobs_messages(settings, redis_client, redis_url, queue_prefix, tmp_path):
    kept = submit_published(settings, "kept", 5)
    doomed = submit_published(settings, "doomed", 1200)   # more than one chunk of the queue
    some = submit_published(settings, "some", 4)
    assert redis_client.llen(settings.queue_name) == 1209
    env = service_env(settings.database_url, redis_url, tmp_path / "data", queue_prefix)

    out = batchd_cli(["cancel", "--batch", "doomed"], env)
    assert out.returncode == 0, out.stderr.decode()
    assert "cancelled 1200 job(s)" in out.stdout.decode()
    assert "removed 1200 waiting message(s)" in out.stderr.decode()
    assert redis_client.llen(settings.queue_name) == 9

    out = batchd_cli(["cancel", *map(str, some[:2])], env)
    assert out.returncode == 0, out.stderr.decode()
    assert sorted(job_ids_in_queue(redis_client, settings.queue_name)) == sorted(kept + some[2:])
    assert doomed  # (ids of the cancelled batch are gone from the queue above)


def test_cancel_with_the_broker_away_still_cancels(settings, redis_client, queue_prefix, tmp_path):
    [job_id] = submit_published(settings, "b", 1)
    env = service_env(settings.database_url, "redis://127.0.0.1:1/0", tmp_path / "data", queue_prefix)
    out = batchd_cli(["cancel", str(job_id)], env)
    assert out.returncode == 0, out.stderr.decode()
    assert "cancelled 1 job(s)" in out.stdout.decode()
    assert "does not answer" in out.stderr.decode() and "drops them" in out.stderr.decode()


def test_submit_with_the_broker_away_stores_the_jobs_for_the_relay(settings, redis_client, queue_prefix, tmp_path):
    lines = "\n".join(f'{{"custom_id": "doc-{i}", "prompt": "text {i}"}}' for i in range(3))
    env = service_env(settings.database_url, "redis://:secret@127.0.0.1:1/0", tmp_path / "data", queue_prefix)
    out = batchd_cli(["submit", "-", "--batch", "offline"], env, input=lines.encode())
    assert out.returncode == 0, out.stderr.decode()
    said = out.stdout.decode()
    assert "3 new job(s); new jobs are stored as pending: the broker redis://:***@127.0.0.1:1/0 does not answer" in said
    assert "they run when it is back" in said and "secret" not in said + out.stderr.decode()
    with session_scope(settings.database_url) as session:
        assert set(session.scalars(select(Job.status))) == {JobStatus.PENDING}
    relay, _ = make_relay(settings)   # the broker is back
    assert relay.run_once().published == 3
    assert len(job_ids_in_queue(redis_client, settings.queue_name)) == 3
