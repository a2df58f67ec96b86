"""The one task: run a job, given its id. The job's logic is batchd.jobs.runner."""
from __future__ import annotations

import random

from batchd.jobs.publish import TASK_NAME
from batchd.jobs.runner import TransientJobError, current_runner
from batchd.queue.celery_app import app

RETRY_BACKOFF_S = 2.0
RETRY_BACKOFF_MAX_S = 300.0


def retry_countdown(retries: int) -> float:
    """Exponential backoff with full jitter: 2, 4, 8, ... up to 5 minutes."""
    return random.uniform(0, min(RETRY_BACKOFF_MAX_S, RETRY_BACKOFF_S * 2 ** retries))


@app.task(name=TASK_NAME, bind=True, max_retries=8, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_job(self, job_id: int) -> str:
    try:
        return current_runner().run(int(job_id))
    except TransientJobError as exc:
        raise self.retry(exc=exc, countdown=retry_countdown(self.request.retries))
