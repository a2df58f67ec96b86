"""The one task: run a job, given its id. The job's logic is batchd.jobs.runner.

A job that fails raises `JobFailed` once its failure is committed, so that Celery's events,
and Flower, show the task as failed with the job's error kind and message; it is in the task's
`throws`, so the worker logs it in one line, without a traceback. The message is acknowledged
all the same (acks late acknowledges a task that raised): the database holds the failure and
`batchd retry` runs it again.
"""
from __future__ import annotations

import random

from sqlalchemy import select

from batchd.db.models import Job
from batchd.db.session import read_scope
from batchd.jobs.publish import TASK_NAME
from batchd.jobs.runner import TransientJobError, current_runner
from batchd.queue.celery_app import app

RETRY_BACKOFF_S = 2.0
RETRY_BACKOFF_MAX_S = 300.0


class JobFailed(Exception):
    """The job failed; its kind and message are in the database (and in this exception)."""


def retry_countdown(retries: int) -> float:
    """Exponential backoff with full jitter: 2, 4, 8, ... up to 5 minutes."""
    return random.uniform(0, min(RETRY_BACKOFF_MAX_S, RETRY_BACKOFF_S * 2 ** retries))


@app.task(name=TASK_NAME, bind=True, max_retries=8, acks_late=True, reject_on_worker_lost=True, ignore_result=True,
          throws=(JobFailed,))
def run_job(self, job_id: int) -> str:
    runner = current_runner()
    try:
        outcome = runner.run(int(job_id))
    except TransientJobError as exc:
        raise self.retry(exc=exc, countdown=retry_countdown(self.request.retries))
    if outcome == "failed":
        raise JobFailed(failure_of(runner.settings.database_url, int(job_id)))
    return outcome


def failure_of(database_url: str, job_id: int) -> str:
    """`job 17 failed: too_long: the prompt has ...` (the job's row, as the runner committed it)."""
    with read_scope(database_url) as session:
        kind, message = session.execute(select(Job.error_kind, Job.error_message).where(Job.id == job_id)).one()
    return f"job {job_id} failed: {kind}: {message}"
