"""Database connections for one URL: SQLite (the embedded default) or PostgreSQL.

SQLite gets WAL (readers never block the writer), a busy timeout, foreign keys, and
`BEGIN IMMEDIATE` for every transaction, so a read-then-write transaction takes the write
lock up front instead of failing with SQLITE_BUSY when it upgrades. That makes one process's
compare-and-swap UPDATEs as safe against another's on SQLite as on PostgreSQL.

PostgreSQL also gets `statement_engine`: connections in autocommit mode, where a statement is
its own transaction, so a job transition written as one statement (batchd.jobs.lifecycle)
costs one round trip instead of BEGIN, statement, COMMIT.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session, sessionmaker

SQLITE_BUSY_TIMEOUT_MS = 30_000
READ_ONLY = "batchd_read_only"


_engines: dict[tuple[str, str], Engine] = {}
_factories: dict[tuple[str, bool], sessionmaker[Session]] = {}


def db_engine(url: str) -> Engine:
    """One pooled SQLAlchemy engine per URL and process."""
    key = (url, "transactions")
    if key not in _engines:
        parsed = make_url(url)
        if parsed.get_backend_name() == "sqlite":
            _engines[key] = _sqlite_engine(url, parsed.database)
        else:
            _engines[key] = _postgresql_engine(parsed)
    return _engines[key]


def is_postgresql(url: str) -> bool:
    return db_engine(url).dialect.name == "postgresql"


def statement_engine(url: str, *, durable: bool = True) -> Engine:
    """PostgreSQL only: an engine whose connections run in autocommit mode, so that each
    statement is one transaction, atomic as a whole, and one round trip. `durable=False`:
    its commits do not wait for the WAL flush (`synchronous_commit` off), for statements a
    crash may safely undo (a claim, a lease renewal: see batchd.jobs.lifecycle)."""
    key = (url, "statements" if durable else "statements, no flush wait")
    if key not in _engines:
        if not is_postgresql(url):
            raise ValueError(f"statement_engine is for PostgreSQL, not {make_url(url).get_backend_name()}")
        engine = _postgresql_engine(make_url(url), isolation_level="AUTOCOMMIT")
        if not durable:
            @event.listens_for(engine, "connect")
            def _no_flush_wait(dbapi_connection, _record):
                with dbapi_connection.cursor() as cursor:
                    cursor.execute("SET synchronous_commit TO OFF")
                dbapi_connection.commit()
        _engines[key] = engine
    return _engines[key]


def _postgresql_engine(url: URL, **options) -> Engine:
    # no pre-ping (a round trip per checkout): a dropped connection surfaces as an
    # OperationalError, which the worker treats as transient and retries
    return create_engine(with_driver(url), pool_recycle=1800, pool_size=5, max_overflow=5, **options)


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
def one_statement(url: str, *, read_only: bool = False) -> Iterator[Connection]:
    """A connection for one statement that is a transaction by itself: on PostgreSQL in
    autocommit mode (one round trip, no BEGIN or COMMIT); on SQLite inside BEGIN ... COMMIT
    (BEGIN IMMEDIATE unless `read_only`)."""
    if is_postgresql(url):
        with statement_engine(url).connect() as connection:
            yield connection
        return
    engine = db_engine(url).execution_options(**{READ_ONLY: True}) if read_only else db_engine(url)
    with engine.begin() as connection:
        yield connection


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
