"""Jobs a person can fix, on both databases: `submit --replace` gives jobs that have not
succeeded their new input, `retry` takes param overrides and keeps the errors it clears in the
job's events, and `delete --batch` removes a batch."""
from __future__ import annotations

import pytest
from click.testing import CliRunner
from sqlalchemy import func, select

from batchd.cli.main import main
from batchd.db.models import Batch, Job, JobEvent, JobStatus, Result
from batchd.db.session import session_scope
from batchd.db.types import utcnow
from batchd.engine.errors import BadInputError
from batchd.engine.types import GenerationResult, Telemetry
from batchd.jobs import lifecycle
from batchd.jobs.inputs import JobInput
from batchd.jobs.manage import BatchNotFinished, delete_batch, retry
from batchd.jobs.progress import UnknownBatch
from batchd.jobs.publish import Publisher
from batchd.jobs.runner import result_row
from batchd.jobs.submit import submit_jobs
from batchd.queue.celery_app import configure
from tests.service.test_relay import job_ids_in_queue


def prompt_job(custom_id: str, prompt: str, **params) -> JobInput:
    return JobInput(custom_id=custom_id, source="t", prompt=prompt, params=params)


def jobs(settings, batch="b") -> dict[str, Job]:
    with session_scope(settings.database_url) as session:
        return {j.custom_id: j for j in session.scalars(select(Job).join(Batch).where(Batch.name == batch))}


def events(settings, job_id: int) -> list[tuple[str, str]]:
    with session_scope(settings.database_url) as session:
        return [tuple(row) for row in session.execute(select(JobEvent.event, JobEvent.detail)
                                                       .where(JobEvent.job_id == job_id).order_by(JobEvent.id))]


def claim(settings, job_id: int, worker="w1"):
    with session_scope(settings.database_url) as session:
        session.get(Job, job_id).status = JobStatus.QUEUED
    return lifecycle.claim(settings.database_url, job_id, worker, 60)


def a_result() -> dict:
    """A results row as the runner writes it (these tests pin what happens to the job rows)."""
    generated = GenerationResult(text="done", token_ids=[1], output_sha256="0" * 64, token_ids_sha256="1" * 64,
                                 prompt_tokens=3, effective_prompt_tokens=3, generated_tokens=1, finish_reason="eos",
                                 telemetry=Telemetry(), fingerprint={})
    now = utcnow()
    return result_row(generated, queue_wait_s=0.0, worker_host="h", worker_id="w1", started_at=now, finished_at=now)


def succeed(settings, job_id: int) -> None:
    claim(settings, job_id)
    assert lifecycle.complete(settings.database_url, job_id, "w1", a_result())


# ---- submit --replace -----------------------------------------------------------------------

def test_replace_gives_unfinished_and_failed_jobs_their_new_input(settings):
    first = submit_jobs(settings, "b", [prompt_job("pending", "old"), prompt_job("failed", "old", temperature=-1),
                                        prompt_job("done", "old"), prompt_job("same", "same")])
    assert [c for c, _ in first.rejected] == ["failed"]
    succeed(settings, jobs(settings)["done"].id)
    second = [prompt_job("pending", "new"), prompt_job("failed", "new"), prompt_job("done", "new"),
              prompt_job("same", "same")]

    kept = submit_jobs(settings, "b", second)
    assert (kept.changed_inputs, kept.replaced, kept.job_ids) == (["pending", "failed", "done"], [], [])
    assert {c: j.prompt for c, j in jobs(settings).items()} == {"pending": "old", "failed": "old", "done": "old",
                                                                "same": "same"}

    report = submit_jobs(settings, "b", second, replace=True)
    assert report.replaced == [("pending", "pending"), ("failed", "failed")]
    assert report.kept_succeeded == ["done"] and report.already_present == 4 and report.new_jobs == 0
    after = jobs(settings)
    assert {c: (j.prompt, j.status) for c, j in after.items()} == {
        "pending": ("new", JobStatus.PENDING), "failed": ("new", JobStatus.PENDING),
        "done": ("old", JobStatus.SUCCEEDED), "same": ("same", JobStatus.PENDING)}
    assert sorted(report.job_ids) == sorted([after["pending"].id, after["failed"].id])
    assert after["failed"].error_kind is None and after["failed"].params == {}
    assert after["failed"].input_sha256 == second[1].input_sha256
    history = events(settings, after["failed"].id)
    assert history[0][0] == "rejected" and "temperature" in history[0][1]   # the old error stays
    assert history[1] == ("replaced", "new input (the job was failed)")


def test_a_replaced_input_that_is_invalid_fails_with_its_own_message(settings):
    submit_jobs(settings, "b", [prompt_job("x", "fine")])
    report = submit_jobs(settings, "b", [prompt_job("x", "fine", top_p=7)], replace=True)
    assert report.replaced == [("x", "pending")] and report.job_ids == []
    [(custom_id, message)] = report.rejected
    job = jobs(settings)["x"]
    assert (job.status, job.error_kind, job.error_message) == (JobStatus.FAILED, "bad_input", message)
    assert "top_p" in message and events(settings, job.id)[-1] == ("replaced", f"new input (the job was pending); "
                                                                               f"rejected: {message}")


def test_a_running_job_whose_input_is_replaced_cannot_commit_its_old_result(settings):
    [job_id] = submit_jobs(settings, "b", [prompt_job("x", "old")]).job_ids
    assert claim(settings, job_id) is not None
    submit_jobs(settings, "b", [prompt_job("x", "new")], replace=True)
    assert not lifecycle.complete(settings.database_url, job_id, "w1", a_result())   # the worker's result is dropped
    job = jobs(settings)["x"]
    assert (job.status, job.prompt, job.attempts, job.worker_id) == (JobStatus.PENDING, "new", 0, None)


def test_replaced_jobs_are_published_with_the_new_ones(settings, redis_client):
    publisher = Publisher(settings, configure(settings, settings.broker_url))
    [old_id] = submit_jobs(settings, "b", [prompt_job("x", "old")]).job_ids
    report = submit_jobs(settings, "b", [prompt_job("x", "new"), prompt_job("y", "y")], publisher=publisher,
                         replace=True)
    new_id = jobs(settings)["y"].id
    assert report.published == 2 and job_ids_in_queue(redis_client, settings.queue_name) == [new_id, old_id]
    assert jobs(settings)["x"].status == JobStatus.QUEUED


def test_submit_on_the_command_line_says_what_it_replaced_and_what_it_kept(settings, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("a", "b"):
        (docs / f"{name}.txt").write_text(f"first {name}")
    env = {"BATCHD_DATABASE_URL": settings.database_url, "BATCHD_DATA_DIR": str(tmp_path)}
    submit = ["submit", str(docs), "--batch", "b", "--no-publish"]
    assert CliRunner().invoke(main, submit, env=env).exit_code == 0
    a, b = (str(docs.resolve() / f"{name}.txt") for name in ("a", "b"))
    succeed(settings, jobs(settings)[b].id)
    for name in ("a", "b"):
        (docs / f"{name}.txt").write_text(f"second {name}")
    kept = CliRunner().invoke(main, submit, env=env)
    assert kept.stderr.splitlines() == [
        f"kept {a}: the batch already holds this custom_id with a different input; submit with --replace to run "
        "the new one",
        f"kept {b}: the batch already holds this custom_id with a different input; submit with --replace to run "
        "the new one"]
    replaced = CliRunner().invoke(main, submit + ["--replace"], env=env)
    assert replaced.stderr.splitlines() == [
        f"replaced {a}: its input is the new one (the job was pending; it runs again)",
        f"kept {b}: it already succeeded with its earlier input, which --replace does not change; give the new "
        "input another custom_id to run it"]
    assert replaced.stdout.startswith("batch b: 0 new job(s), 1 replaced, 2 already in the batch")


# ---- retry ----------------------------------------------------------------------------------

def test_retry_with_overrides_keeps_the_cleared_error_in_the_events(settings):
    [job_id] = submit_jobs(settings, "b", [prompt_job("long", "a long document", max_new_tokens=8)]).job_ids
    claim(settings, job_id)
    message = "the prompt has 9000 tokens: submit with --compress auto"
    lifecycle.fail(settings.database_url, job_id, "w1", "too_long", message, False)

    report = retry(settings.database_url, batch="b", error_kind="too_long", params={"compress": "auto"})
    assert report.retried == [job_id] and report.not_retried == []
    job = jobs(settings)["long"]
    assert (job.status, job.error_kind, job.params) == (JobStatus.PENDING, None, {"max_new_tokens": 8,
                                                                                   "compress": "auto"})
    history = events(settings, job_id)
    assert history[-2] == ("failed", f"too_long: {message}")
    assert history[-1] == ("retried", f"was failed: too_long: {message}; retried with compress='auto'")


def test_a_job_whose_input_was_refused_is_not_retried_and_keeps_its_message(settings):
    rejected = JobInput(custom_id="openai-line", source="t", error="unknown key 'body', 'method', 'url'")
    submit_jobs(settings, "b", [rejected, prompt_job("hot", "fine", temperature=-1)])
    report = retry(settings.database_url, batch="b")
    assert report.retried == [] and sorted(report.not_retried) == [
        ("hot", "param temperature=-1: expected a number >= 0 (0 is greedy)"),
        ("openai-line", "unknown key 'body', 'method', 'url'")]
    assert jobs(settings)["openai-line"].error_message == "unknown key 'body', 'method', 'url'"
    fixed = retry(settings.database_url, batch="b", params={"temperature": 0.5})   # an override that fixes one
    assert fixed.retried == [jobs(settings)["hot"].id] and [c for c, _ in fixed.not_retried] == ["openai-line"]
    assert jobs(settings)["hot"].params == {"temperature": 0.5}


def test_a_bad_override_is_refused_before_anything_changes(settings):
    [job_id] = submit_jobs(settings, "b", [prompt_job("x", "p")]).job_ids
    claim(settings, job_id)
    lifecycle.fail(settings.database_url, job_id, "w1", "oom", "out of memory", True)
    with pytest.raises(BadInputError, match="compress"):
        retry(settings.database_url, batch="b", params={"compress": "sometimes"})
    assert jobs(settings)["x"].status == JobStatus.FAILED


def test_retry_on_the_command_line_takes_overrides_but_not_the_environment(settings, tmp_path):
    [job_id] = submit_jobs(settings, "b", [prompt_job("x", "p", max_new_tokens=4)]).job_ids
    for with_overrides in (False, True):
        claim(settings, job_id)
        lifecycle.fail(settings.database_url, job_id, "w1", "too_long", "too long", False)
        env = {"BATCHD_DATABASE_URL": settings.database_url, "BATCHD_DATA_DIR": str(tmp_path),
               "BATCHD_BROKER_URL": settings.broker_url, "BATCHD_QUEUE_PREFIX": settings.queue_prefix,
               "BATCHD_COMPRESS": "always"}   # a worker's default: not an override
        args = ["retry", "--batch", "b"] + (["--compress", "auto", "--keep-ratio", "0.25"] if with_overrides else [])
        result = CliRunner().invoke(main, args, env=env)
        assert result.exit_code == 0, result.output
        expected = {"max_new_tokens": 4, **({"compress": "auto", "keep_ratio": 0.25} if with_overrides else {})}
        assert jobs(settings)["x"].params == expected
    assert "retrying 1 job(s) with compress='auto', keep_ratio=0.25; 1 queued now" in result.stdout


def test_retry_on_the_command_line_says_what_it_did_not_retry(settings, tmp_path):
    submit_jobs(settings, "b", [JobInput(custom_id="r1", source="t", error="unknown key 'body'")])
    env = {"BATCHD_DATABASE_URL": settings.database_url, "BATCHD_DATA_DIR": str(tmp_path),
           "BATCHD_BROKER_URL": settings.broker_url, "BATCHD_QUEUE_PREFIX": settings.queue_prefix}
    result = CliRunner().invoke(main, ["retry", "--batch", "b"], env=env)
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "not retried r1: unknown key 'body'; fix its input and submit it again with --replace",
        "Error: no job could be retried"]


# ---- delete ---------------------------------------------------------------------------------

def count(settings, table) -> int:
    with session_scope(settings.database_url) as session:
        return session.scalar(select(func.count()).select_from(table))


def test_delete_removes_a_batch_with_its_jobs_results_and_events(settings):
    ids = submit_jobs(settings, "gone", [prompt_job("a", "p"), prompt_job("b", "p")]).job_ids
    submit_jobs(settings, "kept", [prompt_job("a", "p")])
    succeed(settings, ids[0])
    with pytest.raises(BatchNotFinished, match="'gone' has 1 unfinished job"):
        delete_batch(settings.database_url, "gone")
    assert delete_batch(settings.database_url, "gone", force=True) == 2
    assert (count(settings, Batch), count(settings, Job), count(settings, Result), count(settings, JobEvent)) == \
        (1, 1, 0, 1)
    with pytest.raises(UnknownBatch):
        delete_batch(settings.database_url, "gone")


def test_delete_on_the_command_line_asks_first(settings, tmp_path):
    [job_id] = submit_jobs(settings, "b", [prompt_job("a", "p")]).job_ids
    succeed(settings, job_id)
    env = {"BATCHD_DATABASE_URL": settings.database_url, "BATCHD_DATA_DIR": str(tmp_path)}
    declined = CliRunner().invoke(main, ["delete", "--batch", "b"], input="n\n", env=env)
    assert declined.exit_code == 1 and count(settings, Batch) == 1
    assert "Delete batch 'b': 1 job(s) with their results and events?" in declined.output
    done = CliRunner().invoke(main, ["delete", "--batch", "b", "--yes"], env=env)
    assert done.exit_code == 0 and done.stdout == "deleted batch b: 1 job(s)\n" and count(settings, Batch) == 0
    missing = CliRunner().invoke(main, ["delete", "--batch", "b", "--yes"], env=env)
    assert missing.exit_code == 1 and missing.stderr == "Error: no batch named 'b'; `batchd status` lists them\n"
