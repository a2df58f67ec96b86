"""`batchd delete`: remove a batch with its jobs, results and events."""
from __future__ import annotations

import click

from batchd.cli.context import CliContext, pass_cli
from batchd.jobs.manage import BatchNotFinished, delete_batch
from batchd.jobs.progress import batch_progress


@click.command("delete")
@click.option("--batch", "batch_name", required=True, help="The batch to delete.")
@click.option("--force", is_flag=True, help="Delete even while jobs are pending, queued or running.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@pass_cli
def delete(cli: CliContext, batch_name: str, force: bool, yes: bool) -> None:
    """Delete a batch: its jobs, their results and their events (there is no undo)."""
    settings = cli.database(cli.settings())
    jobs = batch_progress(settings.database_url, batch_name).total   # a clear error for an unknown batch
    if not yes:
        click.confirm(f"Delete batch {batch_name!r}: {jobs} job(s) with their results and events?", abort=True)
    try:
        deleted = delete_batch(settings.database_url, batch_name, force=force)
    except BatchNotFinished as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"deleted batch {batch_name}: {deleted} job(s)")


COMMANDS = [delete]
