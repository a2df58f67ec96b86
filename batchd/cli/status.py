"""`batchd status`: all batches, or one batch's progress bar with throughput and ETA."""
from __future__ import annotations

import sys
import time
from typing import Optional

import click

from batchd.cli.context import CliContext, pass_cli
from batchd.config import Settings
from batchd.jobs.heartbeat import unserved_models
from batchd.jobs.progress import BatchProgress, all_batches, batch_progress, workers_in_flight
from batchd.report.totals import format_duration, status_counts

BAR_WIDTH = 30


def progress_line(p: BatchProgress) -> str:
    filled = int(BAR_WIDTH * p.finished / p.total) if p.total else BAR_WIDTH
    bar = "#" * filled + "." * (BAR_WIDTH - filled)
    return f"{p.name} [{bar}] {p.finished}/{p.total} | {status_counts(p) or 'empty'} | {_pace(p)}"


def _pace(p: BatchProgress) -> str:
    rate = f"{p.jobs_per_s * 60:.1f} jobs/min, {p.tokens_per_s:.1f} tok/s"
    if p.done:
        busy = f" (workers busy {format_duration(p.busy_s)})" if p.first_started_at else ""
        return f"done in {format_duration(p.wall_s)}{busy}, {rate}"
    if p.first_started_at is None:
        return "waiting for a worker"
    if p.eta_s is None:
        return f"{rate} | ETA after the first result"
    return f"{rate} | ETA {format_duration(p.eta_s)}"


def worker_line(load) -> str:
    return (f"worker {load.worker_id}: {load.in_flight} job{'s' if load.in_flight != 1 else ''} in flight"
            + (f" from {load.batches} batches" if load.batches > 1 else ""))


@click.command("status")
@click.option("--batch", "batch_name", envvar="BATCHD_BATCH", help="Show this batch's progress.")
@click.option("--watch/--no-watch", default=None, help="Redraw until the batch is done (default: on a terminal).")
@click.option("--interval", type=float, default=1.0, show_default=True, help="Seconds between redraws.")
@pass_cli
def status(cli: CliContext, batch_name: Optional[str], watch: Optional[bool], interval: float) -> None:
    """Progress of one batch (--batch), or a line per batch."""
    settings = cli.database(cli.settings())
    if batch_name is None:
        batches = all_batches(settings.database_url)
        if not batches:
            click.echo("no batches yet: `batchd submit FILES --batch NAME`")
        for p in batches:
            click.echo(progress_line(p))
            echo_unserved(settings, p)
        for load in workers_in_flight(settings.database_url):
            click.echo(worker_line(load))
        return
    watch = sys.stdout.isatty() if watch is None else watch
    p = batch_progress(settings.database_url, batch_name)
    if not watch:
        click.echo(progress_line(p))
    echo_unserved(settings, p)
    while watch:
        p = batch_progress(settings.database_url, batch_name)
        click.echo("\r\x1b[2K" + progress_line(p), nl=False)
        if p.done:
            click.echo()
            return
        time.sleep(interval)


def echo_unserved(settings: Settings, p: BatchProgress) -> None:
    """A line per model that the batch's waiting jobs name and no live worker serves."""
    if p.done:
        return
    for model in unserved_models(settings.database_url, p.batch_id, settings.model_name, settings.unserved_after_s):
        click.echo(f"  {model.line()}")


COMMANDS = [status]
