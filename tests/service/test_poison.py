"""No poison loops (issue 38, item 2), on SQLite and PostgreSQL with real Redis: a value its
column cannot hold is refused at submit and at claim, a permanent database error fails the job
at once, a row whose JSON is broken fails as that job's bad_input, and a job that keeps coming
back is terminal after `max_attempts` deliveries.

The runner runs over test_lifecycle's LoopDouble/EngineDouble (queue and database mechanics);
tests/service/test_hardening_live.py runs the same rows through a real worker."""
from __future__ import annotations

import sqlite3
from concurrent.futures import Future

import pytest
import sqlalchemy as sa

from batchd.db.errors import is_transient
from batchd.db.session import db_engine, session_scope
from batchd.jobs.engine_loop import LoopOutcome
from batchd.jobs.inputs import JobInput
from batchd.jobs.runner import JobRunner, TransientJobError
from batchd.jobs.submit import submit_jobs
from tests.service.test_lifecycle import EngineDouble, LoopDouble, events, job, make_queued, result_count, submit
from tests.service.test_relay import make_relay

BEYOND_INT32, BEYOND_INT64 = 10**10, 2**70


def is_postgresql(url: str) -> bool:
    return url.startswith("postgresql")


def raised(url: str, statement: str, params=None) -> Exception:
    with pytest.raises(Exception) as info:
        with db_engine(url).connect() as connection:
            connection.execute(sa.text(statement), params or {})
    return info.value


def test_is_transient_tells_the_database_away_from_the_statement(database_url):
    assert not is_transient(raised(database_url, "SELECT * FROM no_such_table"))
    assert not is_transient(raised(database_url, "INSERT INTO batches (name) VALUES (NULL)"))  # NOT NULL
    if is_postgresql(database_url):
        assert not is_transient(raised(database_url, "SELECT 2147483648::int"))  # integer out of range
        assert not is_transient(raised(database_url, "SELECT '{not json'::json"))
        # the server ends our session (an admin, a restart): the next statement finds it gone
        with db_engine(database_url).connect() as connection:
            with pytest.raises(sa.exc.DBAPIError) as info:
                connection.execute(sa.text("SELECT pg_terminate_backend(pg_backend_pid())"))
                connection.execute(sa.text("SELECT 1"))
        assert is_transient(info.value)
        refused = sa.create_engine("postgresql+psycopg2://postgres@127.0.0.1:1/test")
        with pytest.raises(sa.exc.OperationalError) as info:
            refused.connect()
        assert is_transient(info.value)
    else:
        with pytest.raises(OverflowError) as info:  # sqlite3 cannot bind an int beyond 64 bits
            with db_engine(database_url).begin() as connection:
                connection.execute(sa.text("UPDATE jobs SET attempts = :n"), {"n": BEYOND_INT64})
        assert not is_transient(info.value)
        path = database_url.removeprefix("sqlite:///")
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")   # another writer holds the lock
        try:
            impatient = sa.create_engine(database_url, connect_args={"timeout": 0})
            with pytest.raises(sa.exc.OperationalError) as info:
                with impatient.begin() as connection:
                    connection.execute(sa.text("UPDATE jobs SET attempts = 0"))
            assert is_transient(info.value)  # database is locked
            impatient.dispose()
        finally:
            holder.rollback()
            holder.close()


@pytest.mark.parametrize("value", [BEYOND_INT32, BEYOND_INT64], ids=["10^10", "2^70"])
@pytest.mark.parametrize("key", ["top_k", "max_new_tokens"])
def test_integers_beyond_their_column_are_refused_at_submit(settings, key, value):
    report = submit_jobs(settings, "big", [JobInput(custom_id="big", source="t", prompt="p", params={key: value}),
                                           JobInput(custom_id="fine", source="t", prompt="p", params={key: 5})])
    assert len(report.job_ids) == 1
    [(custom_id, message)] = report.rejected
    assert custom_id == "big" and f"param {key}={value}: too large; at most {2**31 - 1}" in message


@pytest.mark.parametrize("value", [BEYOND_INT32, BEYOND_INT64], ids=["10^10", "2^70"])
def test_top_k_written_by_sql_fails_at_claim_not_at_the_result(settings, value):
    [job_id] = submit(settings)
    with session_scope(settings.database_url) as session:   # JSON text, as a person's INSERT writes it
        session.execute(sa.text(f"UPDATE jobs SET params = '{{\"top_k\": {value}}}' WHERE id = :id"), {"id": job_id})
    make_queued(settings, [job_id])
    engine = EngineDouble()
    assert JobRunner(settings, LoopDouble(engine), "w1").run(job_id) == "failed"
    failed = job(settings, job_id)
    assert engine.calls == 0 and failed.attempts == 1
    assert (failed.error_kind, failed.retryable) == ("bad_input", False) and "top_k" in failed.error_message


@pytest.mark.parametrize("column, text", [("params", "{not json"), ("messages", "[not json")])
def test_a_pending_row_with_broken_json_fails_once(settings, redis_client, column, text):
    insert = (f"INSERT INTO jobs (batch_id, custom_id, {'prompt, ' if column == 'params' else ''}{column}) "
              f"SELECT id, 'broken', {repr('x') + ', ' if column == 'params' else ''}:text FROM batches")
    with session_scope(settings.database_url) as session:
        session.execute(sa.text("INSERT INTO batches (name) VALUES ('sql')"))
    if is_postgresql(settings.database_url):  # the json type refuses it: such a row cannot exist
        error = raised(settings.database_url, insert, {"text": text})
        assert isinstance(error, sa.exc.DataError) and "json" in str(error)
        return
    with session_scope(settings.database_url) as session:
        session.execute(sa.text(insert), {"text": text})
        job_id = session.scalar(sa.text("SELECT id FROM jobs"))
    relay, _ = make_relay(settings)
    assert relay.run_once().published == 1
    engine = EngineDouble()
    assert JobRunner(settings, LoopDouble(engine), "w1").run(job_id) == "failed"
    with db_engine(settings.database_url).connect() as connection:   # the ORM would parse the broken JSON
        failed = connection.execute(sa.text("SELECT status, error_kind, error_message, attempts FROM jobs")).one()
    assert (failed.status, failed.error_kind, failed.attempts) == ("failed", "bad_input", 1) and engine.calls == 0
    assert f"the job's {column} is not valid JSON" in failed.error_message
    assert not relay.run_once()   # nothing left to publish, requeue or republish


def refuse_results(url: str) -> None:
    """Make the database refuse every result row: a real permanent error of the result INSERT."""
    with db_engine(url).begin() as connection:
        if is_postgresql(url):
            connection.execute(sa.text("ALTER TABLE results ADD CONSTRAINT refuse_all CHECK (job_id < 0) NOT VALID"))
        else:
            connection.execute(sa.text("CREATE TRIGGER refuse_all BEFORE INSERT ON results "
                                       "BEGIN SELECT RAISE(ABORT, 'results refused'); END"))


def test_a_result_the_database_refuses_fails_the_job_once(settings):
    [job_id] = submit(settings)
    make_queued(settings, [job_id])
    refuse_results(settings.database_url)
    engine = EngineDouble()
    assert JobRunner(settings, LoopDouble(engine), "w1").run(job_id) == "failed"  # no TransientJobError: no retry
    failed = job(settings, job_id)
    assert (failed.status, failed.error_kind, failed.retryable, failed.attempts) == ("failed", "internal", False, 1)
    assert "the database refused to store this job (IntegrityError" in failed.error_message
    assert engine.calls == 1 and result_count(settings, job_id) == 0


class HandsBackEveryJob:
    """Test double of EngineLoop whose batch hands every job back (as it does after running out
    of device memory in a step): the transient outcome that used to loop without end."""

    def __init__(self):
        self.submitted = 0

    def submit(self, job_id, request) -> Future:
        self.submitted += 1
        future = Future()
        future.set_result(LoopOutcome(requeue="out of device memory in a batch step"))
        return future

    def cancel(self, job_id, reason="cancelled"):
        pass


def test_a_job_handed_back_every_time_fails_after_max_attempts(settings):
    [job_id] = submit(settings)
    make_queued(settings, [job_id])
    loop = HandsBackEveryJob()
    runner = JobRunner(settings, loop, "w1")
    for attempt in range(1, settings.max_attempts):
        with pytest.raises(TransientJobError):
            runner.run(job_id)
        assert (job(settings, job_id).status, job(settings, job_id).attempts) == ("queued", attempt)
    assert runner.run(job_id) == "failed"
    failed = job(settings, job_id)
    assert loop.submitted == settings.max_attempts == failed.attempts
    assert (failed.status, failed.error_kind, failed.retryable) == ("failed", "oom", True)
    assert f"gave up after {settings.max_attempts} deliveries" in failed.error_message
    assert events(settings, job_id).count("released") == settings.max_attempts - 1
    assert runner.run(job_id) == "ignored"   # a late message changes nothing
