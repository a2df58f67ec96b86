"""The Celery app, configured for hour-long GPU jobs (docs/design.md section 1).

- acks late and reject on worker lost: a job's message is acknowledged when the job is over,
  so a worker that dies mid-job leaves the message to be delivered again;
- a threads pool of `max_jobs` threads with prefetch 1 (CUDA does not survive fork, and the
  jobs share one engine): a worker holds one message per job in flight (batchd.worker);
- the Redis visibility timeout is above the longest job, or Redis would hand a running job's
  message to a second worker;
- JSON only: nothing on the wire is pickled, and messages carry a job id;
- time limits are the job runner's (soft: the job leaves the batch; hard: the worker exits):
  Celery's threads pool cannot interrupt a thread;
- one queue per model name.

`celery --app batchd.queue.celery_app:app flower` works with BATCHD_BROKER_URL set. Workers do
not send task events unless asked: each is a broker round trip before the job starts, and
Flower asks for them itself (it broadcasts `enable_events` to the workers it watches).
"""
from __future__ import annotations

import os

from celery import Celery

from batchd.config import Settings

app = Celery("batchd", include=["batchd.queue.tasks"])


def celery_config(settings: Settings, broker_url: str, concurrency: int = 1) -> dict:
    return {
        "broker_url": broker_url,
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": {"visibility_timeout": settings.visibility_timeout_s},
        "task_serializer": "json",
        "result_serializer": "json",
        "event_serializer": "json",
        "accept_content": ["json"],
        "task_ignore_result": True,  # results live in the database
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "worker_pool": "threads",
        "worker_concurrency": concurrency,
        "task_default_queue": settings.queue_name,
        "task_create_missing_queues": True,
        "worker_hijack_root_logger": False,
        "worker_redirect_stdouts": False,  # `batchd run` prints its own progress and results
        "worker_send_task_events": False,  # Flower turns them on (module docstring)
        "worker_cancel_long_running_tasks_on_connection_loss": False,  # the database decides, not the socket
        "enable_utc": True,
    }


def configure(settings: Settings, broker_url: str, concurrency: int = 1) -> Celery:
    """Point the app at a broker; a different broker than before drops the pooled connections."""
    if app.conf.broker_url not in (None, broker_url):
        _drop_pooled_connections()
    app.conf.update(celery_config(settings, broker_url, concurrency))
    return app


def _drop_pooled_connections() -> None:
    """Celery caches a connection pool and a producer pool for the first broker it meets and
    offers no public reset short of `close()` (which also deregisters the app); a process that
    switches brokers (tests, benchmarks) resets them the way Celery does after a fork."""
    for pool in (app._pool, getattr(app.__dict__.get("amqp"), "_producer_pool", None)):
        if pool is not None:
            pool.force_close_all()
    app._pool = None
    if "amqp" in app.__dict__:
        app.__dict__["amqp"]._producer_pool = None


if os.environ.get("BATCHD_BROKER_URL") or os.environ.get("BATCHD_BROKER_URL_FILE"):  # Flower, `celery` tools
    _settings = Settings.from_env()
    configure(_settings, _settings.broker_url)   # normalised: kombu cannot take ?password=
