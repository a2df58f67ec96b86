"""Initial schema: batches, jobs, results, job_events and the job_results view.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""
from __future__ import annotations

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: Union[str, None] = None
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

JOB_STATUSES = ("pending", "queued", "running", "succeeded", "failed", "cancelled", "expired")


def timestamp(name: str, nullable: bool = True, now_default: bool = False) -> sa.Column:
    default = sa.text("CURRENT_TIMESTAMP") if now_default else None
    return sa.Column(name, sa.DateTime(timezone=True), server_default=default, nullable=nullable)


def json(name: str, nullable: bool = False, empty_default: bool = False) -> sa.Column:
    default = sa.text("'{}'") if empty_default else None
    return sa.Column(name, sa.JSON(none_as_null=True), server_default=default, nullable=nullable)


def floats(*names: str, nullable: bool = False) -> list[sa.Column]:
    return [sa.Column(name, sa.Double(), nullable=nullable) for name in names]


def ints(*names: str, nullable: bool = False) -> list[sa.Column]:
    return [sa.Column(name, sa.Integer(), nullable=nullable) for name in names]


def upgrade() -> None:
    op.create_table(
        "batches",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("model", sa.String(64), nullable=True),
        json("params", empty_default=True),
        timestamp("created_at", nullable=False, now_default=True),
        timestamp("cancelled_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batches")),
        sa.UniqueConstraint("name", name=op.f("uq_batches_name")),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("batch_id", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.String(255), nullable=False),
        sa.Column("model", sa.String(64), nullable=True),
        sa.Column("prompt", sa.Text(), nullable=True),
        json("messages", nullable=True),
        json("params", empty_default=True),
        sa.Column("input_sha256", sa.String(64), nullable=True),
        sa.Column("status", sa.Enum(*JOB_STATUSES, name="job_status", native_enum=False, create_constraint=True,
                                    length=16), server_default="pending", nullable=False),
        timestamp("created_at", nullable=False, now_default=True),
        timestamp("pending_at", nullable=False, now_default=True),
        *[timestamp(f"{status}_at") for status in JOB_STATUSES[1:]],
        timestamp("expires_at"),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("worker_id", sa.String(255), nullable=True),
        timestamp("lease_expires_at"),
        sa.Column("error_kind", sa.String(32), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("retryable", sa.Boolean(), nullable=True),
        sa.CheckConstraint("(prompt IS NULL) <> (messages IS NULL)", name=op.f("ck_jobs_prompt_xor_messages")),
        sa.CheckConstraint("attempts >= 0", name=op.f("ck_jobs_attempts_not_negative")),
        sa.ForeignKeyConstraint(["batch_id"], ["batches.id"], name=op.f("fk_jobs_batch_id_batches"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
        sa.UniqueConstraint("batch_id", "custom_id", name=op.f("uq_jobs_batch_id_custom_id")),
    )
    op.create_index("ix_jobs_batch_id_status", "jobs", ["batch_id", "status"])
    op.create_index("ix_jobs_status_lease_expires_at", "jobs", ["status", "lease_expires_at"])

    op.create_table(
        "job_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        timestamp("at", nullable=False, now_default=True),
        sa.Column("event", sa.String(32), nullable=False),
        sa.Column("worker_id", sa.String(255), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_job_events_job_id_jobs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_events")),
    )
    op.create_index(op.f("ix_job_events_job_id"), "job_events", ["job_id"])

    op.create_table(
        "results",
        sa.Column("job_id", sa.Integer(), nullable=False),
        timestamp("created_at", nullable=False, now_default=True),
        # output
        sa.Column("output_text", sa.Text(), nullable=False),
        sa.Column("output_sha256", sa.String(64), nullable=False),
        sa.Column("token_ids_sha256", sa.String(64), nullable=False),
        *ints("prompt_tokens", "effective_prompt_tokens", "generated_tokens"),
        sa.Column("finish_reason", sa.String(16), nullable=False),
        # configuration fingerprint
        sa.Column("target_sha256", sa.String(64), nullable=True),
        sa.Column("drafter_sha256", sa.String(64), nullable=True),
        sa.Column("drafter_path", sa.Text(), nullable=True),
        sa.Column("dtype", sa.String(16), nullable=True),
        sa.Column("kv_dtype", sa.String(16), nullable=True),
        *floats("temperature", nullable=True),
        *ints("top_k", nullable=True),
        *floats("top_p", nullable=True),
        sa.Column("seed", sa.BigInteger(), nullable=True),
        *ints("max_new_tokens", "spec_width", nullable=True),
        sa.Column("compress_mode", sa.String(16), nullable=True),
        *floats("keep_ratio", "compression_ratio", nullable=True),
        json("fingerprint"),
        # engine telemetry
        *floats("park_s", "drafter_load_s", "scoring_s", "unpark_s", "prefill_s", "decode_s", "total_s",
                "prefill_tokens_per_s", "decode_tokens_per_s"),
        sa.Column("spec_method", sa.String(16), nullable=False),
        *ints("spec_steps", "spec_draft_tokens_offered", "spec_draft_tokens_accepted"),
        *floats("acceptance_rate", "mean_accepted_length", nullable=True),
        json("acceptance_per_position"),
        *floats("draft_s", "verify_s"),
        sa.Column("spec_disabled", sa.Boolean(), nullable=False),
        sa.Column("spec_disabled_reason", sa.Text(), nullable=True),
        sa.Column("compressed", sa.Boolean(), nullable=False),
        *ints("compress_tokens_before", "compress_drafter_tokens_kept", nullable=True),
        *floats("compress_s"),
        sa.Column("peak_device_memory_bytes", sa.BigInteger(), nullable=True),
        sa.Column("device", sa.String(64), nullable=False),
        json("notes"),
        # service telemetry
        *floats("queue_wait_s", nullable=True),
        sa.Column("worker_host", sa.String(255), nullable=False),
        sa.Column("worker_id", sa.String(255), nullable=False),
        timestamp("engine_started_at", nullable=False),
        timestamp("engine_finished_at", nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_results_job_id_jobs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_results")),
    )
    op.create_index(op.f("ix_results_output_sha256"), "results", ["output_sha256"])
    op.execute(JOB_RESULTS_VIEW)


def downgrade() -> None:
    op.execute("DROP VIEW job_results")
    op.drop_table("results")
    op.drop_table("job_events")
    op.drop_table("jobs")
    op.drop_table("batches")


# One row per job, with its batch name and (when it succeeded) its result and telemetry:
# what an analyst queries, e.g. SELECT custom_id, output_sha256, decode_tokens_per_s FROM job_results.
JOB_RESULTS_VIEW = """
CREATE VIEW job_results AS
SELECT
    b.name AS batch, j.batch_id, j.id AS job_id, j.custom_id, j.model, j.status,
    j.attempts, j.worker_id, j.error_kind, j.error_message, j.retryable,
    j.created_at, j.queued_at, j.running_at, j.succeeded_at, j.failed_at, j.cancelled_at, j.expired_at,
    r.output_text, r.output_sha256, r.token_ids_sha256,
    r.prompt_tokens, r.effective_prompt_tokens, r.generated_tokens, r.finish_reason,
    r.target_sha256, r.drafter_sha256, r.drafter_path, r.dtype, r.kv_dtype,
    r.temperature, r.top_k, r.top_p, r.seed, r.max_new_tokens, r.spec_width,
    r.compress_mode, r.keep_ratio, r.compression_ratio,
    r.queue_wait_s, r.park_s, r.drafter_load_s, r.scoring_s, r.unpark_s, r.compress_s,
    r.prefill_s, r.decode_s, r.total_s, r.prefill_tokens_per_s, r.decode_tokens_per_s,
    r.spec_method, r.spec_steps, r.spec_draft_tokens_offered, r.spec_draft_tokens_accepted,
    r.acceptance_rate, r.mean_accepted_length, r.acceptance_per_position, r.draft_s, r.verify_s,
    r.spec_disabled, r.spec_disabled_reason, r.compressed, r.compress_tokens_before,
    r.compress_drafter_tokens_kept, r.peak_device_memory_bytes, r.device, r.worker_host, r.notes,
    r.engine_started_at, r.engine_finished_at
FROM jobs j
JOIN batches b ON b.id = j.batch_id
LEFT JOIN results r ON r.job_id = j.id
"""
