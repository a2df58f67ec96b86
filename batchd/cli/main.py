"""`batchd`: the command group, its global options, and one-line errors for a person's mistakes."""
from __future__ import annotations

import logging

import click
from sqlalchemy.exc import OperationalError as DatabaseUnreachable

from batchd import __version__
from batchd.cli.context import CliContext
from batchd.config import redact_url
from batchd.db.migrate import SchemaOutOfDate
from batchd.jobs.inputs import InputError
from batchd.jobs.progress import UnknownBatch
from batchd.engine.errors import EngineError


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
            url = redact_url(ctx.obj.settings().database_url) if isinstance(ctx.obj, CliContext) else "database"
            raise click.ClickException(f"cannot use {url}: {detail}") from None
        except Exception as exc:
            if _is_broker_error(exc):
                raise click.ClickException(f"cannot reach the broker: {exc}") from None
            raise


def _is_broker_error(exc: Exception) -> bool:
    from kombu.exceptions import OperationalError as BrokerUnreachable

    return isinstance(exc, BrokerUnreachable)


@click.group(cls=BatchdGroup, context_settings={"help_option_names": ["-h", "--help"], "show_default": False})
@click.option("--database-url", envvar="BATCHD_DATABASE_URL", help="SQLAlchemy URL (default: sqlite in the data dir).")
@click.option("--broker-url", envvar="BATCHD_BROKER_URL", help="Redis URL (default: embedded broker in the data dir).")
@click.option("--data-dir", envvar="BATCHD_DATA_DIR", help="Folder of the embedded defaults (default ./batchd-data).")
@click.option("--queue-prefix", envvar="BATCHD_QUEUE_PREFIX", help="Queue names are <prefix>.<model name>.")
@click.option("-v", "--verbose", count=True, help="More logging (-vv: debug).")
@click.version_option(__version__, prog_name="batchd")
@click.pass_context
def main(ctx: click.Context, database_url, broker_url, data_dir, queue_prefix, verbose) -> None:
    """Queue-driven batch generation: submit documents, run workers, read results from SQL."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx.obj = CliContext(overrides={"database_url": database_url, "broker_url": broker_url, "data_dir": data_dir,
                                    "queue_prefix": queue_prefix})


def _register() -> None:
    from batchd.cli import (cancel, db, delete, events, generate, health, relay, report, results, retry, run,
                            status, submit, worker)

    for module in (submit, status, results, report, events, cancel, retry, delete, worker, relay, run, generate, db,
                   health):
        for command in module.COMMANDS:
            main.add_command(command)


_register()
