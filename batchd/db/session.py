"""Database connections for one URL: SQLite (the embedded default) or PostgreSQL.

SQLite gets WAL (readers never block the writer), a busy timeout, foreign keys, and
`BEGIN IMMEDIATE` for every transaction, so a read-then-write transaction takes the write
lock up front instead of failing with SQLITE_BUSY when it upgrades. That makes one process's
compare-and-swap UPDATEs as safe against another's on SQLite as on PostgreSQL.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session, sessionmaker

SQLITE_BUSY_TIMEOUT_MS = 30_000
READ_ONLY = "batchd_read_only"


_engines: dict[str, Engine] = {}
_factories: dict[tuple[str, bool], sessionmaker[Session]] = {}


def db_engine(url: str) -> Engine:
    """One pooled SQLAlchemy engine per URL and process."""
    if url not in _engines:
        parsed = make_url(url)
        if parsed.get_backend_name() == "sqlite":
            _engines[url] = _sqlite_engine(url, parsed.database)
        else:
            # no pre-ping (a round trip per checkout): a dropped connection surfaces as an
            # OperationalError, which the worker treats as transient and retries
            _engines[url] = create_engine(with_driver(parsed), pool_recycle=1800, pool_size=5, max_overflow=5)
    return _engines[url]


def with_driver(url: URL) -> URL:
    """`postgresql://` means psycopg 3 to SQLAlchemy 2.1; batchd ships psycopg2, so a URL that
    names no driver gets whichever of the two is installed."""
    if url.drivername != "postgresql":
        return url
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return url.set(drivername="postgresql+psycopg2")
    return url.set(drivername="postgresql+psycopg")


def _sqlite_engine(url: str, database: str | None) -> Engine:
    if database and database != ":memory:":
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves (below)
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection):
        # readers (status, export) take no lock; in WAL mode they see the last commit
        read_only = connection.get_execution_options().get(READ_ONLY, False)
        connection.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

    return engine


def session_factory(url: str, read_only: bool = False) -> sessionmaker[Session]:
    key = (url, read_only)
    if key not in _factories:
        bind = db_engine(url).execution_options(**{READ_ONLY: True}) if read_only else db_engine(url)
        _factories[key] = sessionmaker(bind, expire_on_commit=False)
    return _factories[key]


@contextmanager
def session_scope(url: str) -> Iterator[Session]:
    """A session whose transaction commits on success and rolls back on error."""
    with session_factory(url).begin() as session:
        yield session


@contextmanager
def read_scope(url: str) -> Iterator[Session]:
    """A session for reading only (on SQLite it takes no write lock)."""
    with session_factory(url, read_only=True).begin() as session:
        yield session


def dispose_all() -> None:
    """Close pooled connections and forget the engines (at the end of a test, or after fork)."""
    for engine in _engines.values():
        engine.dispose()
    _engines.clear()
    _factories.clear()
