"""Shared state of one `batchd` invocation (`ctx.obj`) and the database/broker it opens."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import click

from batchd.config import Settings
from batchd.db.migrate import ensure_schema


@dataclass
class CliContext:
    overrides: dict[str, Any] = field(default_factory=dict)  # group options; None means "from env"

    def settings(self, **more: Any) -> Settings:
        """Settings from BATCHD_* with the command line's options on top."""
        try:
            return Settings.from_env(**{**self.overrides, **{k: v for k, v in more.items() if v is not None}})
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None

    def database(self, settings: Settings) -> Settings:
        """Make sure the schema is current: the embedded SQLite migrates itself; a shared
        server must be migrated by `batchd db upgrade` (the compose `migrate` service)."""
        ensure_schema(settings.database_url, auto_upgrade=settings.is_sqlite)
        return settings


pass_cli = click.make_pass_decorator(CliContext, ensure=True)


def echo_err(message: str) -> None:
    click.echo(message, err=True)
