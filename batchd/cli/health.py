"""`batchd health`: exit 0 when the database is migrated and the broker answers (healthchecks)."""
from __future__ import annotations

import click
import redis

from batchd.cli.context import CliContext, pass_cli
from batchd.config import redact_url
from batchd.db import migrate
from batchd.embedded import running_broker_url


@click.command("health")
@pass_cli
def health(cli: CliContext) -> None:
    """Check the database schema and the broker; one line each."""
    settings = cli.settings()
    revision = migrate.current_revision(settings.database_url)
    if revision != migrate.head_revision(settings.database_url):
        raise click.ClickException(f"database at revision {revision}, not the latest: run `batchd db upgrade`")
    click.echo(f"database ok: {redact_url(settings.database_url)} at revision {revision}")
    broker_url = settings.broker_url or running_broker_url(settings.data_dir)
    if broker_url is None:
        click.echo("broker: embedded, not running (a worker, relay or run starts it)")
        return
    try:
        redis.Redis.from_url(broker_url, socket_timeout=5, socket_connect_timeout=5).ping()
    except redis.RedisError as exc:
        raise click.ClickException(f"broker {redact_url(broker_url)} does not answer: {exc}") from None
    click.echo(f"broker ok: {redact_url(broker_url)}")


COMMANDS = [health]
