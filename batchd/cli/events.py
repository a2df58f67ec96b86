"""`batchd events JOB`: a job's history, one event a line."""
from __future__ import annotations

import json
from typing import Optional

import click

from batchd.cli.context import CliContext, pass_cli
from batchd.jobs.history import UnknownJob, job_history


@click.command("events")
@click.argument("job", required=True)
@click.option("--batch", "batch_name", help="JOB is a custom_id of this batch (else a job id).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per event.")
@pass_cli
def events(cli: CliContext, job: str, batch_name: Optional[str], as_json: bool) -> None:
    """The history of JOB (a job id, or a custom_id with --batch): submit, publish, claims,
    requeues, failures with their messages, retries, cancels."""
    settings = cli.database(cli.settings())
    try:
        if batch_name is None:
            if not job.isdigit():
                raise click.ClickException(f"{job!r} is not a job id: give one, or the custom_id with --batch NAME")
            history = job_history(settings.database_url, int(job))
        else:
            history = job_history(settings.database_url, batch=batch_name, custom_id=job)
    except UnknownJob as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        for at, event, worker, detail in history.events:
            click.echo(json.dumps({"job_id": history.job_id, "at": at.isoformat(), "event": event, "worker_id": worker,
                                   "detail": detail}, ensure_ascii=False))
        return
    click.echo(f"job {history.job_id}: {history.custom_id} of batch {history.batch}, {history.status}, "
               f"{history.attempts} attempt(s)")
    for at, event, worker, detail in history.events:
        parts = [at.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC", f"{event:<16}"]
        if worker:
            parts.append(f"[{worker}]")
        if detail:
            parts.append(detail)
        click.echo("  ".join(parts).rstrip())


COMMANDS = [events]
