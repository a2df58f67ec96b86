"""`batchd health`: exit 0 when the database is migrated and the broker answers (healthchecks);
with `--worker`, also when the worker on this host is alive: its metrics endpoint answers, its
engine loop and lease keeper threads run, and an engine holding jobs has stepped recently."""
from __future__ import annotations

import urllib.request

import click
import redis

from batchd.cli.context import CliContext, pass_cli
from batchd.db import migrate
from batchd.embedded import running_broker_url
from batchd.urls import mask_secrets, mask_url


@click.command("health")
@click.option("--worker", "check_worker", is_flag=True,
              help="Also check the worker serving metrics on BATCHD_METRICS_PORT here (its compose healthcheck).")
@click.option("--max-step-age", type=float, default=600.0, show_default=True,
              help="With --worker: seconds without an engine step while jobs are in flight that count as stuck.")
@pass_cli
def health(cli: CliContext, check_worker: bool, max_step_age: float) -> None:
    """Check the database schema and the broker (and the worker); one line each."""
    settings = cli.settings()
    revision = migrate.current_revision(settings.database_url)
    if revision != migrate.head_revision(settings.database_url):
        raise click.ClickException(f"database at revision {revision}, not the latest: run `batchd db upgrade`")
    click.echo(f"database ok: {mask_url(settings.database_url)} at revision {revision}")
    broker_url = settings.broker_url or running_broker_url(settings.data_dir)
    if broker_url is None:
        click.echo("broker: embedded, not running (a worker, relay or run starts it)")
    else:
        try:
            redis.Redis.from_url(broker_url, socket_timeout=5, socket_connect_timeout=5).ping()
        except redis.RedisError as exc:
            raise click.ClickException(mask_secrets(f"broker {mask_url(broker_url)} does not answer: {exc}",
                                                    [broker_url])) from None
        click.echo(f"broker ok: {mask_url(broker_url)}")
    if check_worker:
        if settings.metrics_port is None:
            raise click.ClickException("--worker reads the worker's metrics: set BATCHD_METRICS_PORT for the worker "
                                       "and for this check")
        click.echo(worker_health(f"http://127.0.0.1:{settings.metrics_port}/metrics", max_step_age))


def worker_health(metrics_url: str, max_step_age: float) -> str:
    """One line saying the worker is fine, or a ClickException saying what is wrong."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as response:
            text = response.read().decode()
    except OSError as exc:
        raise click.ClickException(f"worker metrics at {metrics_url} do not answer ({exc}): is the worker up?") from None
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, sample.labels.get("thread"))] = sample.value
    for thread in ("engine", "lease"):
        if samples.get(("batchd_worker_thread_alive", thread)) != 1.0:
            raise click.ClickException(f"worker at {metrics_url}: its {thread} thread is not running")
    in_flight = samples.get(("batchd_worker_jobs_in_flight", None), 0.0)
    since_step = samples.get(("batchd_worker_seconds_since_step", None), 0.0)
    if in_flight > 0 and since_step > max_step_age:
        raise click.ClickException(f"worker at {metrics_url}: {in_flight:.0f} job(s) in flight and no engine step for "
                                   f"{since_step:.0f} s (stuck?)")
    return f"worker ok: {in_flight:.0f} job(s) in flight, last engine step {since_step:.0f} s ago"


COMMANDS = [health]
