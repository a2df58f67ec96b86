"""`batchd cancel`: stop jobs that have not finished."""
from __future__ import annotations

import click

from batchd.cli.context import CliContext, pass_cli
from batchd.jobs.manage import cancel as cancel_jobs


@click.command("cancel")
@click.argument("job_ids", nargs=-1, type=int)
@click.option("--batch", "batch_name", envvar="BATCHD_BATCH", help="Cancel every unfinished job of this batch.")
@pass_cli
def cancel(cli: CliContext, job_ids: tuple[int, ...], batch_name) -> None:
    """Cancel pending, queued and running jobs (a running job's result is discarded)."""
    if not job_ids and not batch_name:
        raise click.UsageError("give --batch NAME or job ids")
    settings = cli.database(cli.settings())
    n = cancel_jobs(settings.database_url, batch=batch_name, job_ids=job_ids if not batch_name else None)
    click.echo(f"cancelled {n} job(s)")


COMMANDS = [cancel]
