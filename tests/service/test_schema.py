"""The database: migrations agree with the models, every telemetry field has its column,
and the job_results view an analyst queries holds what docs/design.md section 2 lists."""
from __future__ import annotations

import dataclasses

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from batchd.db import migrate
from batchd.db.models import Base, Result
from batchd.db.session import db_engine
from batchd.engine.types import GenerationResult, Telemetry


def test_migrations_match_models(empty_database_url):
    migrate.upgrade(empty_database_url)
    with db_engine(empty_database_url).connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        assert compare_metadata(context, Base.metadata) == []


def test_upgrade_is_idempotent_and_reports_head(empty_database_url):
    assert migrate.current_revision(empty_database_url) is None
    migrate.upgrade(empty_database_url)
    migrate.upgrade(empty_database_url)
    assert migrate.current_revision(empty_database_url) == migrate.head_revision(empty_database_url)


def test_every_telemetry_field_has_a_result_column():
    columns = set(Result.__table__.columns.keys())
    missing = [f.name for f in dataclasses.fields(Telemetry) if f.name not in columns]
    assert missing == []


def test_every_result_field_has_a_column():
    columns = set(Result.__table__.columns.keys())
    renamed = {"text": "output_text", "telemetry": None, "fingerprint": "fingerprint", "token_ids": None}
    for field in dataclasses.fields(GenerationResult):
        column = renamed.get(field.name, field.name)
        assert column is None or column in columns, field.name


def test_job_results_view_has_results_and_telemetry(database_url):
    with db_engine(database_url).connect() as connection:
        view_columns = set(connection.execute(sa.text("SELECT * FROM job_results")).keys())
    wanted = {"batch", "custom_id", "status", "error_kind", "error_message", "output_text", "output_sha256",
              "prompt_tokens", "effective_prompt_tokens", "generated_tokens", "target_sha256", "queue_wait_s",
              "worker_host", "device"}
    wanted |= {f.name for f in dataclasses.fields(Telemetry)}
    assert wanted - view_columns == set()
