"""Alembic, driven from Python: `batchd db upgrade`, and the schema check every command makes.

The migrations live in the repository's migrations/ folder, beside the batchd package; a wheel
carries the same folder as batchd/migrations (setup.py), so installed and editable copies both run.
The repository's alembic.ini is for Alembic's own command line (new revisions); these functions
configure Alembic in code and do not read it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from batchd.db.session import db_engine

PACKAGE_ROOT = Path(__file__).resolve().parents[1]   # batchd/
REPO_ROOT = PACKAGE_ROOT.parent                      # a checkout's root, or site-packages


def migrations_dir() -> Path:
    """batchd/migrations in an installed wheel, else migrations/ beside the package (a checkout)."""
    candidates = (PACKAGE_ROOT / "migrations", REPO_ROOT / "migrations")
    for candidate in candidates:
        if (candidate / "env.py").is_file():
            return candidate
    raise FileNotFoundError(f"no Alembic migrations in {' or '.join(map(str, candidates))}: "
                            "install batchd from its wheel or run it from a checkout (pip install -e .)")


class SchemaOutOfDate(RuntimeError):
    pass


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("path_separator", "os")
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["configure_logging"] = False
    return cfg


def head_revision(url: str) -> str:
    return ScriptDirectory.from_config(alembic_config(url)).get_current_head()


def current_revision(url: str) -> Optional[str]:
    with db_engine(url).connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate inside one transaction on our own connection (SQLite: BEGIN IMMEDIATE, so two
    processes that upgrade at once take turns)."""
    cfg = alembic_config(url)
    with db_engine(url).begin() as connection:
        cfg.attributes["connection"] = connection
        command.upgrade(cfg, revision)


def ensure_schema(url: str, *, auto_upgrade: bool) -> None:
    """Upgrade (the embedded SQLite default) or refuse with what to run (a shared server)."""
    if current_revision(url) == head_revision(url):
        return
    if auto_upgrade:
        upgrade(url)
        return
    raise SchemaOutOfDate("the database schema is not at the latest revision: run `batchd db upgrade`")
