"""`batchd`: the command group, its global options, and one-line errors for a person's mistakes."""
from __future__ import annotations

import logging
from typing import Optional

import click
from sqlalchemy.exc import OperationalError as DatabaseUnreachable

from batchd import __version__
from batchd.cli.context import CliContext
from batchd.config import Settings
from batchd.db.migrate import SchemaOutOfDate
from batchd.jobs.inputs import InputError
from batchd.jobs.progress import UnknownBatch
from batchd.engine.errors import EngineError
from batchd.urls import mask_secrets, mask_url


class BatchdGroup(click.Group):
    """Turns the errors a person can fix into one line (`Error: ...`) instead of a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (InputError, UnknownBatch, SchemaOutOfDate) as exc:
            raise click.ClickException(str(exc)) from None
        except EngineError as exc:
            raise click.ClickException(f"{exc.kind}: {exc.message}") from None
        except DatabaseUnreachable as exc:
            detail = str(exc.orig or exc).strip().splitlines()[0]
            settings = _settings(ctx)
            where = mask_url(settings.database_url) if settings else "the database"
            raise click.ClickException(_masked(ctx, f"cannot use {where}: {detail}")) from None
        except Exception as exc:
            if _is_broker_error(exc):
                raise click.ClickException(_masked(ctx, f"cannot reach the broker: {exc}")) from None
            raise


def _settings(ctx: click.Context) -> Optional[Settings]:
    if not isinstance(ctx.obj, CliContext):
        return None
    try:
        return ctx.obj.settings()
    except click.ClickException:
        return None


def _masked(ctx: click.Context, message: str) -> str:
    """`message` with the passwords of this invocation's URLs, as given and as used, masked."""
    given = ctx.obj.overrides if isinstance(ctx.obj, CliContext) else {}
    settings = _settings(ctx)
    used = [settings.database_url, settings.broker_url] if settings else []
    return mask_secrets(message, [given.get("database_url"), given.get("broker_url"), *used])


def _is_broker_error(exc: Exception) -> bool:
    from kombu.exceptions import OperationalError as BrokerUnreachable

    return isinstance(exc, BrokerUnreachable)


@click.group(cls=BatchdGroup, context_settings={"help_option_names": ["-h", "--help"], "show_default": False})
@click.option("--database-url", envvar="BATCHD_DATABASE_URL",
              help="SQLAlchemy URL (default: sqlite in the data dir). A password in it shows in `ps` when given "
                   "here: set BATCHD_DATABASE_URL, use --database-url-file, or leave it out and let PostgreSQL "
                   "read PGPASSFILE (~/.pgpass) or PGPASSWORD.")
@click.option("--database-url-file", envvar="BATCHD_DATABASE_URL_FILE", type=click.Path(dir_okay=False),
              help="A file holding the database URL (a Docker secret, say): keeps its password off the command line.")
@click.option("--broker-url", envvar="BATCHD_BROKER_URL",
              help="Redis URL (default: embedded broker in the data dir), redis://:PASSWORD@host:6379/0 or "
                   "?password=. A password in it shows in `ps` when given here: set BATCHD_BROKER_URL or use "
                   "--broker-url-file.")
@click.option("--broker-url-file", envvar="BATCHD_BROKER_URL_FILE", type=click.Path(dir_okay=False),
              help="A file holding the broker URL: keeps its password off the command line.")
@click.option("--data-dir", envvar="BATCHD_DATA_DIR", help="Folder of the embedded defaults (default ./batchd-data).")
@click.option("--queue-prefix", envvar="BATCHD_QUEUE_PREFIX", help="Queue names are <prefix>.<model name>.")
@click.option("-v", "--verbose", count=True, help="More logging (-vv: debug).")
@click.version_option(__version__, prog_name="batchd")
@click.pass_context
def main(ctx: click.Context, database_url, database_url_file, broker_url, broker_url_file, data_dir, queue_prefix,
         verbose) -> None:
    """Queue-driven batch generation: submit documents, run workers, read results from SQL."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx.obj = CliContext(overrides={"database_url": database_url, "database_url_file": database_url_file,
                                    "broker_url": broker_url, "broker_url_file": broker_url_file,
                                    "data_dir": data_dir, "queue_prefix": queue_prefix})


def _register() -> None:
    from batchd.cli import (cancel, db, delete, events, generate, health, relay, report, results, retry, run,
                            status, submit, worker)

    for module in (submit, status, results, report, events, cancel, retry, delete, worker, relay, run, generate, db,
                   health):
        for command in module.COMMANDS:
            main.add_command(command)


_register()
