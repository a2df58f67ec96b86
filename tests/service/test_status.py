"""`batchd status` tells the truth: a finished batch shows its real span (first submit to last
result) and the rate over it, a retry does not shorten the span, and the ETA of a running batch
comes from measured token throughput, so long documents still to come make it longer."""
from __future__ import annotations

from datetime import timedelta

import pytest

from batchd.cli.status import progress_line
from batchd.report.totals import format_duration, totals_lines
from batchd.jobs import lifecycle
from batchd.jobs.manage import retry
from batchd.jobs.progress import batch_progress
from batchd.jobs.publish import Publisher
from batchd.queue.celery_app import configure
from tests.service.batch_history import WORKER, PastJob, write_batch
from tests.service.conftest import batchd_cli, service_env

SUBMITTED_AGO = 16 * 60     # the batch waited for a worker most of this time ...
FIRST_CLAIM_AGO = 11        # ... which then ran it in 11 s


def sixteen_minute_batch(settings, name="overnight"):
    jobs = [PastJob(f"doc-{i}", f"document {i}", submitted_ago=SUBMITTED_AGO, claimed_ago=FIRST_CLAIM_AGO - i,
                    finished_ago=FIRST_CLAIM_AGO - i - 5, prompt_tokens=100, generated_tokens=20) for i in range(3)]
    jobs.append(PastJob("doc-bad", "document", outcome="failed", submitted_ago=SUBMITTED_AGO, claimed_ago=3,
                        finished_ago=0, error_kind="too_long", error_message="the prompt does not fit"))
    return write_batch(settings, name, jobs), jobs


def test_a_finished_batch_shows_its_span_from_submit_and_its_rate_over_it(settings):
    sixteen_minute_batch(settings)
    progress = batch_progress(settings.database_url, "overnight")
    assert progress.done
    assert progress.wall_s == pytest.approx(SUBMITTED_AGO, abs=1)
    assert progress.busy_s == pytest.approx(FIRST_CLAIM_AGO, abs=1)
    assert progress.jobs_per_s * 60 == pytest.approx(4 / (SUBMITTED_AGO / 60), rel=0.01)
    assert progress.documents_per_hour == pytest.approx(3 * 3600 / SUBMITTED_AGO, rel=0.01)
    line = progress_line(progress)
    assert f"done in {format_duration(SUBMITTED_AGO)} (workers busy {format_duration(FIRST_CLAIM_AGO)})" in line, line
    assert f"{4 / (SUBMITTED_AGO / 60):.1f} jobs/min" in line, line


def test_the_status_command_prints_the_real_span(settings, redis_url, queue_prefix, tmp_path):
    sixteen_minute_batch(settings)
    env = service_env(settings.database_url, redis_url, tmp_path / "data", queue_prefix)
    out = batchd_cli(["status", "--batch", "overnight", "--no-watch"], env)
    assert out.returncode == 0, out.stderr.decode()
    assert f"done in {format_duration(SUBMITTED_AGO)}" in out.stdout.decode()


def test_a_retry_keeps_the_span_from_the_first_claim(settings, redis_url):
    ids, _ = sixteen_minute_batch(settings)
    assert retry(settings.database_url, job_ids=[ids["doc-bad"]]).retried == [ids["doc-bad"]]
    Publisher(settings, configure(settings, redis_url)).publish_pending([ids["doc-bad"]])
    assert lifecycle.claim(settings.database_url, ids["doc-bad"], WORKER, 60) is not None   # running_at: now
    progress = batch_progress(settings.database_url, "overnight")
    assert not progress.done
    assert progress.busy_s == pytest.approx(FIRST_CLAIM_AGO, abs=1)   # from the first claim, not the retry's
    assert progress.wall_s == pytest.approx(SUBMITTED_AGO, abs=1)


def running_batch(settings, name: str, remaining_chars: int):
    """Two jobs done in the first 100 s of work (400 characters, 100 prompt tokens and 50
    generated each), one of `remaining_chars` characters still queued."""
    done = [PastJob(f"done-{i}", "x" * 400, submitted_ago=200, claimed_ago=100, finished_ago=50 - i,
                    prompt_tokens=100, generated_tokens=50) for i in range(2)]
    waiting = PastJob("waiting", "y" * remaining_chars, outcome="pending", submitted_ago=200)
    write_batch(settings, name, [*done, waiting])
    progress = batch_progress(settings.database_url, name)
    progress.now = progress.first_started_at + timedelta(seconds=100)   # read exactly 100 s into the work
    return progress


def test_the_eta_comes_from_measured_token_throughput(settings):
    short, long = running_batch(settings, "short-left", 400), running_batch(settings, "long-left", 1600)
    tokens_per_s = (2 * (100 + 50)) / 100                 # measured: 3 tokens/s
    assert short.work_tokens_per_s == pytest.approx(tokens_per_s)
    # what is left: its characters at 100 tokens per 400 characters, plus 50 generated
    assert short.eta_s == pytest.approx((400 / 4 + 50) / tokens_per_s)
    assert long.eta_s == pytest.approx((1600 / 4 + 50) / tokens_per_s)
    assert f"ETA {format_duration(long.eta_s)}" in progress_line(long)


def test_no_eta_before_a_result_and_waiting_before_a_worker(settings):
    write_batch(settings, "fresh", [PastJob("a", "text", outcome="pending")])
    progress = batch_progress(settings.database_url, "fresh")
    assert progress.eta_s is None and "waiting for a worker" in progress_line(progress)
    write_batch(settings, "started", [PastJob("b", "text", outcome="running", claimed_ago=5)])
    progress = batch_progress(settings.database_url, "started")
    assert "ETA after the first result" in progress_line(progress)


def test_totals_give_wall_time_tokens_and_documents_per_hour(settings):
    sixteen_minute_batch(settings)
    lines = totals_lines(batch_progress(settings.database_url, "overnight"))
    assert lines[0] == "batch overnight: 4 jobs: succeeded 3, failed 1"
    assert lines[1].startswith(f"wall time {format_duration(SUBMITTED_AGO)} (first submit to last result")
    assert "300 prompt" in lines[2] and "60 generated" in lines[2]
    assert lines[3].startswith(f"{3 * 3600 / SUBMITTED_AGO:,.1f} documents/hour")
