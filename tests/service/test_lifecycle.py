"""The job state machine on both databases: compare-and-swap claim, one result per job,
leases, cancel against a late finish, and the runner's error handling.

`EngineDouble` below is a test double for the engine, used only where the tests pin queue and
database mechanics (what the runner writes for each way a job can end); the real engine runs
in test_worker.py.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
import time
from datetime import timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy import select

from batchd.db.models import Job, JobEvent, JobStatus, Result
from batchd.db.session import session_scope
from batchd.db.types import utcnow
from batchd.jobs import lifecycle
from batchd.jobs.inputs import JobInput
from batchd.jobs.manage import cancel, retry
from batchd.jobs.runner import JobRunner
from batchd.jobs.submit import submit_jobs
from batchd.engine.errors import DeviceOutOfMemoryError, EngineError, InternalError, PromptTooLongError
from batchd.jobs.engine_loop import LoopOutcome
from batchd.engine.types import GenerationResult, Telemetry


def submit(settings, n=1, batch="b", params=None):
    jobs = [JobInput(custom_id=f"job-{i}", source="test", prompt=f"prompt {i}", params=params or {}) for i in range(n)]
    return submit_jobs(settings, batch, jobs).job_ids


def make_queued(settings, job_ids):
    with session_scope(settings.database_url) as session:
        session.execute(sa.update(Job).where(Job.id.in_(job_ids))
                        .values(status=JobStatus.QUEUED, queued_at=utcnow() - timedelta(seconds=2)))


def job(settings, job_id) -> Job:
    with session_scope(settings.database_url) as session:
        return session.get(Job, job_id)


def result_count(settings, job_id) -> int:
    with session_scope(settings.database_url) as session:
        return session.scalar(select(sa.func.count()).select_from(Result).where(Result.job_id == job_id))


class LoopDouble:
    """Test double of batchd.jobs.engine_loop.EngineLoop over an EngineDouble: each job runs
    `generate` in its own thread; a cancel resolves the job's future at once."""

    def __init__(self, engine):
        self.engine = engine
        self.futures: dict[int, Future] = {}

    @property
    def calls(self) -> int:
        return self.engine.calls

    def submit(self, job_id, request) -> Future:
        future = self.futures[job_id] = Future()

        def work():
            try:
                outcome = LoopOutcome(result=self.engine.generate(request))
            except EngineError as exc:
                outcome = LoopOutcome(error=exc)
            except Exception as exc:  # a bug in the engine: what the loop reports
                outcome = LoopOutcome(error=InternalError(f"{type(exc).__name__}: {exc}"))
            if not future.done():
                future.set_result(outcome)

        threading.Thread(target=work, daemon=True).start()
        return future

    def cancel(self, job_id, reason="cancelled"):
        if not self.futures[job_id].done():
            self.futures[job_id].set_result(LoopOutcome(cancelled=reason))


def runner_for(settings, engine) -> JobRunner:
    return JobRunner(settings, LoopDouble(engine), "w1")


class EngineDouble:
    """Test double of engine.runtime.Engine.generate for runner mechanics tests (no model)."""

    def __init__(self, raises: Exception | None = None, sleep_s: float = 0.0):
        self.raises = raises
        self.sleep_s = sleep_s
        self.calls = 0

    def generate(self, request):
        self.calls += 1
        time.sleep(self.sleep_s)
        if self.raises is not None:
            raise self.raises
        text = "double output"
        return GenerationResult(
            text=text, token_ids=[1, 2, 3], output_sha256="0" * 64, token_ids_sha256="1" * 64, prompt_tokens=4,
            effective_prompt_tokens=4, generated_tokens=3, finish_reason="length",
            telemetry=Telemetry(prefill_s=0.01, decode_s=0.02, total_s=0.03, acceptance_per_position=[0.5],
                                notes=["double"]),
            fingerprint={"target_sha256": "f" * 64, "dtype": "float32", "kv_dtype": "float32", "temperature": 0.0,
                         "top_k": 0, "top_p": 1.0, "seed": None, "max_new_tokens": 3, "spec_method": "none",
                         "spec_width": None, "compress": "off"})


def test_claim_is_compare_and_swap(settings):
    [job_id] = submit(settings)
    assert lifecycle.claim(settings.database_url, job_id, "w1", 30) is None  # still pending: not claimable
    make_queued(settings, [job_id])
    claimed = lifecycle.claim(settings.database_url, job_id, "w1", 30)
    assert claimed is not None and claimed.status == JobStatus.RUNNING and claimed.attempts == 1
    assert lifecycle.claim(settings.database_url, job_id, "w2", 30) is None  # duplicate delivery
    assert job(settings, job_id).worker_id == "w1"


def test_concurrent_claims_one_winner(settings):
    [job_id] = submit(settings)
    make_queued(settings, [job_id])
    winners, barrier = [], threading.Barrier(6)

    def try_claim(worker):
        barrier.wait()
        if lifecycle.claim(settings.database_url, job_id, worker, 30) is not None:
            winners.append(worker)

    threads = [threading.Thread(target=try_claim, args=(f"w{i}",)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1 and job(settings, job_id).worker_id == winners[0]


def test_result_and_succeeded_commit_together_once(settings):
    [job_id] = submit(settings)
    make_queued(settings, [job_id])
    runner = runner_for(settings, EngineDouble())
    assert runner.run(job_id) == "succeeded"
    assert runner.run(job_id) == "ignored"  # redelivered message: nothing happens
    assert runner.jobs.calls == 1
    done = job(settings, job_id)
    assert done.status == JobStatus.SUCCEEDED and done.succeeded_at is not None and done.lease_expires_at is None
    assert result_count(settings, job_id) == 1
    with session_scope(settings.database_url) as session:
        result = session.get(Result, job_id)
        events = list(session.scalars(select(JobEvent.event).where(JobEvent.job_id == job_id).order_by(JobEvent.id)))
    assert result.queue_wait_s is not None and result.queue_wait_s >= 1.5
    assert result.worker_id == "w1" and result.worker_host and result.notes == ["double"]
    assert result.acceptance_per_position == [0.5] and result.target_sha256 == "f" * 64
    assert events == ["submitted", "running", "succeeded", "delivery_ignored"]


def test_a_worker_that_lost_its_job_cannot_write_a_result(settings):
    [job_id] = submit(settings)
    make_queued(settings, [job_id])
    lifecycle.claim(settings.database_url, job_id, "w1", 30)
    cancel(settings.database_url, job_ids=[job_id])
    assert not lifecycle.renew_lease(settings.database_url, job_id, "w1", 30)
    assert not lifecycle.complete(settings.database_url, job_id, "w1", {"output_text": "late"})
    assert job(settings, job_id).status == JobStatus.CANCELLED
    assert result_count(settings, job_id) == 0


def test_a_result_that_cannot_be_written_leaves_the_job_running(settings):
    [job_id] = submit(settings)
    make_queued(settings, [job_id])
    lifecycle.claim(settings.database_url, job_id, "w1", 30)
    with pytest.raises(sa.exc.IntegrityError):  # output_sha256 and the rest are NOT NULL
        lifecycle.complete(settings.database_url, job_id, "w1", {"output_text": "half a result"})
    assert job(settings, job_id).status == JobStatus.RUNNING  # succeeded, result and event: none of them
    assert result_count(settings, job_id) == 0
    assert "succeeded" not in events(settings, job_id)


def test_submit_writes_each_job_and_its_event(settings):
    jobs = [JobInput(custom_id="text", source="t", prompt="Résumé: «x» 'y' \"z\"", params={"seed": 3}),
            JobInput(custom_id="chat", source="t", messages=[{"role": "user", "content": "hi"}]),
            JobInput(custom_id="bad", source="t", prompt="p", params={"temperature": -1})]
    report = submit_jobs(settings, "b", jobs, expires_in_s=60)
    assert len(report.job_ids) == 2 and [custom_id for custom_id, _ in report.rejected] == ["bad"]
    text, chat = (job(settings, job_id) for job_id in report.job_ids)
    assert (text.custom_id, text.prompt, text.messages, text.params) == ("text", jobs[0].prompt, None, {"seed": 3})
    assert (chat.custom_id, chat.prompt, chat.messages) == ("chat", None, [{"role": "user", "content": "hi"}])
    assert text.status == JobStatus.PENDING and text.expires_at > text.created_at and text.attempts == 0
    with session_scope(settings.database_url) as session:
        written = session.execute(select(Job.custom_id, JobEvent.event, JobEvent.detail, Job.error_kind)
                                  .join(JobEvent, JobEvent.job_id == Job.id).order_by(Job.id)).all()
    assert [row[:2] for row in written] == [("text", "submitted"), ("chat", "submitted"), ("bad", "rejected")]
    assert written[0].detail == "pending" and written[2].error_kind == "bad_input" and "temperature" in written[2].detail


def test_only_claims_and_lease_renewals_skip_the_wal_flush(settings):
    if not settings.database_url.startswith("postgresql"):
        pytest.skip("synchronous_commit is PostgreSQL's")
    from batchd.db.session import db_engine, statement_engine

    def flush_setting(engine) -> str:
        with engine.connect() as connection:
            return connection.execute(sa.text("SHOW synchronous_commit")).scalar()
    url = settings.database_url
    assert flush_setting(statement_engine(url, durable=False)) == "off"  # claim, renew_lease
    assert flush_setting(statement_engine(url)) == flush_setting(db_engine(url)) == "on"  # submit, results, failures
    assert not lifecycle.CLAIM.durable and not lifecycle.RENEW_LEASE.durable
    assert all(t.durable for t in (lifecycle.COMPLETE, lifecycle.FAIL, lifecycle.RELEASE))


@pytest.mark.parametrize("error, kind, retryable", [
    (PromptTooLongError("the prompt has 9000 tokens"), "too_long", False),
    (DeviceOutOfMemoryError("out of device memory"), "oom", True),
    (RuntimeError("boom"), "internal", False),
], ids=["too_long", "oom", "bug"])
def test_engine_errors_fail_the_job_with_kind_message_retryable(settings, error, kind, retryable):
    [job_id] = submit(settings)
    make_queued(settings, [job_id])
    assert runner_for(settings, EngineDouble(raises=error)).run(job_id) == "failed"
    failed = job(settings, job_id)
    assert (failed.status, failed.error_kind, failed.retryable) == (JobStatus.FAILED, kind, retryable)
    assert str(error) in failed.error_message and failed.failed_at is not None
    assert result_count(settings, job_id) == 0


def test_a_job_past_its_time_limit_fails_as_timeout(settings):
    [job_id] = submit(settings)
    make_queued(settings, [job_id])
    limited = settings.replace(job_time_limit_s=1.0)  # soft limit: 1 s (at least)
    # the double would answer after 5 s: a job that fails as `timeout` was cut off by the limit
    assert runner_for(limited, EngineDouble(sleep_s=5)).run(job_id) == "failed"
    timed_out = job(settings, job_id)
    assert timed_out.error_kind == "timeout" and timed_out.retryable and "BATCHD_JOB_TIME_LIMIT_S" in timed_out.error_message


def test_bad_params_written_by_sql_fail_in_the_worker(settings):
    [job_id] = submit(settings)
    with session_scope(settings.database_url) as session:
        session.execute(sa.update(Job).where(Job.id == job_id).values(params={"max_new_tokens": -1}))
    make_queued(settings, [job_id])
    engine = EngineDouble()
    assert runner_for(settings, engine).run(job_id) == "failed"
    assert engine.calls == 0
    assert job(settings, job_id).error_kind == "bad_input"


def test_retry_puts_failed_jobs_back_to_pending(settings):
    [job_id] = submit(settings)
    make_queued(settings, [job_id])
    runner_for(settings, EngineDouble(raises=DeviceOutOfMemoryError("oom"))).run(job_id)
    assert retry(settings.database_url, batch="b", error_kind="oom").retried == [job_id]
    again = job(settings, job_id)
    assert again.status == JobStatus.PENDING and again.error_kind is None and again.attempts == 0


def events(settings, job_id) -> list[str]:
    with session_scope(settings.database_url) as session:
        return list(session.scalars(select(JobEvent.event).where(JobEvent.job_id == job_id).order_by(JobEvent.id)))
