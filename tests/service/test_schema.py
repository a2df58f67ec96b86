"""The database: migrations agree with the models, every telemetry field has its column,
and the job_results view an analyst queries holds what docs/design.md section 2 lists."""
from __future__ import annotations

import dataclasses
import json
import re
from datetime import datetime, timezone
from pathlib import Path

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


README = Path(__file__).resolve().parents[2] / "README.md"
# names in the README's job_results paragraph that are not columns of the view: the view
# itself, the results table and its fingerprint column with a key of it, and column values
NOT_VIEW_COLUMNS = {"job_results", "results", "fingerprint", "compress_drafter_sha256",
                    "eos", "stop", "length", "fused", "chain"}


def readme_section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def view_columns(url: str) -> set[str]:
    with db_engine(url).connect() as connection:
        return set(connection.execute(sa.text("SELECT * FROM job_results")).keys())


def test_every_column_the_readme_names_is_in_job_results(database_url):
    paragraph = readme_section("Results in SQL").split("```sql", 1)[0]
    named = set(re.findall(r"`([a-z_0-9]+)`", paragraph))
    assert "decode_mlp" in named and "prompt" in named and "params" in named
    assert named - NOT_VIEW_COLUMNS - view_columns(database_url) == set()


def test_the_readmes_sql_runs_as_written(database_url):
    """The INSERTs of "Jobs from SQL", then the SELECTs of "Results in SQL", verbatim."""
    blocks = [block.split("```", 1)[0] for title in ("Jobs from SQL", "Results in SQL")
              for block in readme_section(title).split("```sql\n")[1:]]
    statements = [s.strip() for block in blocks for s in block.split(";") if s.strip()]
    assert len(statements) == 4
    with db_engine(database_url).begin() as connection:
        for statement in statements:
            connection.execute(sa.text(statement))
        row = connection.execute(sa.text("SELECT custom_id, prompt, params, status FROM job_results")).one()
    params = json.loads(row.params) if isinstance(row.params, str) else row.params
    assert (row.custom_id, row.status, params) == ("report-17", "pending", {"max_new_tokens": 200, "chat": True})


def test_job_results_carries_the_input_and_its_params(settings):
    from batchd.jobs.export import result_rows
    from batchd.jobs.inputs import JobInput
    from batchd.jobs.submit import submit_jobs

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Résumé «x»"}]
    jobs = [JobInput(custom_id="chat", source="t", messages=messages, params={"seed": 3}),
            JobInput(custom_id="text", source="t", prompt="Summarise: ...")]
    submit_jobs(settings, "b", jobs, defaults={"max_new_tokens": 9})
    chat, text = result_rows(settings.database_url, "b")
    assert (chat["prompt"], chat["messages"], chat["params"]) == (None, messages, {"max_new_tokens": 9, "seed": 3})
    assert (text["prompt"], text["messages"], text["params"]) == ("Summarise: ...", None, {"max_new_tokens": 9})
    assert chat["input_sha256"] == jobs[0].input_sha256


def test_upgrading_fills_decode_mlp_from_each_results_fingerprint(empty_database_url):
    """A result written before 0003 had decode_mlp only inside its fingerprint; the upgrade
    copies it into the new column."""
    from batchd.jobs.runner import result_row

    url = empty_database_url
    migrate.upgrade(url, "0002")
    generated = GenerationResult(text="x", token_ids=[1], output_sha256="0" * 64, token_ids_sha256="1" * 64,
                                 prompt_tokens=2, effective_prompt_tokens=2, generated_tokens=1, finish_reason="eos",
                                 telemetry=Telemetry(), fingerprint={"decode_mlp": "fused", "dtype": "float32"})
    now = datetime.now(timezone.utc)
    row = result_row(generated, queue_wait_s=0.0, worker_host="h", worker_id="w", started_at=now, finished_at=now)
    del row["decode_mlp"], row["output_dropped_bytes"]   # no such columns at 0002 (0003, 0004)
    with db_engine(url).begin() as connection:
        connection.execute(sa.text("INSERT INTO batches (name) VALUES ('b')"))
        job_id = connection.execute(sa.text("INSERT INTO jobs (batch_id, custom_id, prompt, status) "
                                            "SELECT id, 'j', 'p', 'succeeded' FROM batches RETURNING id")).scalar()
        connection.execute(sa.insert(Result.__table__).values(job_id=job_id, created_at=now, **row))
    migrate.upgrade(url)
    with db_engine(url).connect() as connection:
        assert connection.execute(sa.text("SELECT decode_mlp FROM job_results")).scalar() == "fused"
