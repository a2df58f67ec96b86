"""`batchd db upgrade` / `batchd db current`: the schema, through Alembic."""
from __future__ import annotations

import click

from batchd.cli.context import CliContext, pass_cli
from batchd.db import migrate
from batchd.urls import mask_url


@click.group("db")
def db() -> None:
    """Database schema (Alembic migrations)."""


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True)
@pass_cli
def upgrade(cli: CliContext, revision: str) -> None:
    """Migrate the database to REVISION."""
    settings = cli.settings()
    migrate.upgrade(settings.database_url, revision)
    click.echo(f"{mask_url(settings.database_url)} is at revision {migrate.current_revision(settings.database_url)}")


@db.command("current")
@pass_cli
def current(cli: CliContext) -> None:
    """Print the database's revision and the latest one."""
    settings = cli.settings()
    click.echo(f"current {migrate.current_revision(settings.database_url)}, "
               f"latest {migrate.head_revision(settings.database_url)}")


COMMANDS = [db]
