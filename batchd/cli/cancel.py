"""`batchd cancel`: stop jobs that have not finished, and take their waiting messages off the queue."""
from __future__ import annotations

import click

from batchd.cli.context import CliContext, echo_err, pass_cli
from batchd.config import Settings, redact_url
from batchd.db.models import JobStatus
from batchd.embedded import broker_url_for
from batchd.jobs.manage import CancelledJob, cancel as cancel_jobs
from batchd.jobs.publish import Publisher
from batchd.queue.broker import BROKER_UNREACHABLE, broker_problem
from batchd.queue.celery_app import configure


@click.command("cancel")
@click.argument("job_ids", nargs=-1, type=int)
@click.option("--batch", "batch_name", envvar="BATCHD_BATCH", help="Cancel every unfinished job of this batch.")
@pass_cli
def cancel(cli: CliContext, job_ids: tuple[int, ...], batch_name) -> None:
    """Cancel pending, queued and running jobs (a running job's result is discarded)."""
    if not job_ids and not batch_name:
        raise click.UsageError("give --batch NAME or job ids")
    settings = cli.database(cli.settings())
    cancelled = cancel_jobs(settings.database_url, batch=batch_name, job_ids=job_ids if not batch_name else None)
    click.echo(f"cancelled {len(cancelled)} job(s)")
    remove_queued_messages(settings, cancelled)


def remove_queued_messages(settings: Settings, cancelled: list[CancelledJob]) -> None:
    """The cancelled jobs' messages out of the broker's queues (the database already says they
    are cancelled: a worker that draws one drops it, so a broker away now costs nothing)."""
    queued = [(job.id, job.model) for job in cancelled if job.was == JobStatus.QUEUED]
    if not queued:
        return
    with broker_url_for(settings, start=False) as broker_url:
        if broker_url is None:
            return   # the embedded broker is not running: its workers drop the messages when they draw them
        problem = broker_problem(broker_url)
        try:
            if problem is None:
                removed = Publisher(settings, configure(settings, broker_url)).remove_messages(queued)
                echo_err(f"removed {removed} waiting message(s) from the queue")
                return
        except BROKER_UNREACHABLE as exc:
            problem = str(exc)
        echo_err(f"note: the broker {redact_url(broker_url)} does not answer ({problem}); the cancelled jobs' "
                 "messages stay in it until a worker draws and drops them")


COMMANDS = [cancel]
