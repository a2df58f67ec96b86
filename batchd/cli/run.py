"""`batchd run`: everything embedded, for one batch: submit, work until done, print results."""
from __future__ import annotations

import sys
import time
import warnings

import click

from batchd.cli.context import CliContext, pass_cli
from batchd.cli.options import generation_options, model_options, submit_options
from batchd.cli.results import results_table
from batchd.cli.status import progress_line
from batchd.report.totals import totals_lines
from batchd.cli.submit import do_submit
from batchd.cli.worker import exit_now, model_settings
from batchd.embedded import broker_url_for
from batchd.jobs.export import result_rows
from batchd.jobs.progress import batch_progress


@click.command("run")
@submit_options
@generation_options
@model_options
@click.option("--show-results/--no-show-results", default=True, show_default=True,
              help="Print the results table at the end.")
@click.option("--loglevel", default="WARNING", show_default=True, type=click.Choice(["DEBUG", "INFO", "WARNING"]))
@pass_cli
def run(cli: CliContext, show_results: bool, loglevel: str, **options) -> None:
    """Submit INPUTS, run a worker (and relay, and broker) until the batch is done, print results."""
    settings = model_settings(cli, options)
    from batchd.worker import load_engine, run_worker   # torch and the engine: only for the commands that run it

    engine = load_engine(settings)
    with broker_url_for(settings, start=True) as broker_url:
        report = do_submit(settings, options)
        batch = report.batch_name
        watcher = ProgressWatcher(settings.database_url, batch)
        if not watcher():
            # JSON only, never pickle: Celery's warning about running as root does not apply
            warnings.filterwarnings("ignore", message=".*superuser privileges.*")
            run_worker(settings, engine, broker_url, relay=True, stop_when=watcher, loglevel=loglevel, quiet=True)
    progress = batch_progress(settings.database_url, batch)
    if show_results:
        click.echo(results_table(list(result_rows(settings.database_url, batch))))
    click.echo("\n".join(totals_lines(progress)))
    exit_now(0 if progress.done else 1)


class ProgressWatcher:
    """The worker's stop condition: true once every job of the batch finished; prints progress."""

    def __init__(self, url: str, batch: str, every_s: float = 30.0):
        self.url, self.batch, self.every_s = url, batch, every_s
        self.last_print, self.last_counts = 0.0, None

    def __call__(self) -> bool:
        """Prints when a job changed state, and every `every_s` seconds otherwise."""
        progress = batch_progress(self.url, self.batch)
        if progress.counts != self.last_counts or time.monotonic() - self.last_print > self.every_s:
            self.last_print, self.last_counts = time.monotonic(), dict(progress.counts)
            click.echo(progress_line(progress), err=True)
            sys.stderr.flush()
        return progress.done


COMMANDS = [run]
