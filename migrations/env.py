"""Alembic environment for batchd.

The URL is the application's (BATCHD_DATABASE_URL, or the embedded SQLite default), unless the
caller passes an open connection in `config.attributes["connection"]`: tests and
`batchd.db.migrate` do that, so a migration can run inside the caller's transaction.
"""
from __future__ import annotations

import logging.config

from alembic import context

from batchd.config import Settings
from batchd.db.models import Base
from batchd.db.session import db_engine
from batchd.db.types import UTCDateTime

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logging", True):
    logging.config.fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def database_url() -> str:
    return config.get_main_option("sqlalchemy.url") or Settings.from_env().database_url


def render_item(type_: str, obj, autogen_context):
    """New revisions spell the app's column types in plain SQLAlchemy (no batchd import)."""
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def configure(**kwargs) -> None:
    context.configure(
        target_metadata=target_metadata,
        render_as_batch=True,  # SQLite rebuilds tables for ALTERs
        compare_type=True,
        render_item=render_item,
        **kwargs,
    )


def run_migrations_offline() -> None:
    configure(url=database_url(), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        configure(connection=connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    with db_engine(database_url()).connect() as connection:
        configure(connection=connection)
        with context.begin_transaction():
            context.run_migrations()
        connection.commit()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
