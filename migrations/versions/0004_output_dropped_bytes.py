"""results.output_dropped_bytes: bytes of an unfinished UTF-8 character held back from the end of
a job's text (engine.whole_chars), in the results table and the job_results view.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-06
"""
from __future__ import annotations

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: Union[str, None] = "0003"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

DROPPED = " r.output_dropped_bytes,"


def upgrade() -> None:
    with op.batch_alter_table("results") as table:   # SQLite rebuilds the table; PostgreSQL alters it
        table.add_column(sa.Column("output_dropped_bytes", sa.Integer(), server_default="0", nullable=False))
    op.execute("DROP VIEW job_results")
    op.execute(JOB_RESULTS_VIEW)


def downgrade() -> None:
    op.execute("DROP VIEW job_results")
    with op.batch_alter_table("results") as table:
        table.drop_column("output_dropped_bytes")
    op.execute(JOB_RESULTS_VIEW.replace(DROPPED, ""))   # 0003's view


# 0003's view with the held-back bytes after the batch telemetry
JOB_RESULTS_VIEW = """
CREATE VIEW job_results AS
SELECT
    b.name AS batch, j.batch_id, j.id AS job_id, j.custom_id, j.model, j.status,
    j.attempts, j.worker_id, j.error_kind, j.error_message, j.retryable,
    j.created_at, j.queued_at, j.running_at, j.succeeded_at, j.failed_at, j.cancelled_at, j.expired_at,
    j.prompt, j.messages, j.params, j.input_sha256,
    r.output_text, r.output_sha256, r.token_ids_sha256,
    r.prompt_tokens, r.effective_prompt_tokens, r.generated_tokens, r.finish_reason,
    r.target_sha256, r.drafter_sha256, r.drafter_path, r.dtype, r.kv_dtype,
    r.temperature, r.top_k, r.top_p, r.seed, r.max_new_tokens, r.spec_width,
    r.compress_mode, r.keep_ratio, r.compression_ratio, r.decode_mlp,
    r.queue_wait_s, r.park_s, r.drafter_load_s, r.scoring_s, r.unpark_s, r.compress_s,
    r.prefill_s, r.decode_s, r.total_s, r.prefill_tokens_per_s, r.decode_tokens_per_s,
    r.slot_wait_s, r.running_s, r.batch_size_mean, r.preemptions, r.output_dropped_bytes,
    r.spec_method, r.spec_steps, r.spec_draft_tokens_offered, r.spec_draft_tokens_accepted,
    r.acceptance_rate, r.mean_accepted_length, r.acceptance_per_position, r.draft_s, r.verify_s,
    r.spec_disabled, r.spec_disabled_reason, r.compressed, r.compress_tokens_before,
    r.compress_drafter_tokens_kept, r.peak_device_memory_bytes, r.device, r.worker_host, r.notes,
    r.engine_started_at, r.engine_finished_at
FROM jobs j
JOIN batches b ON b.id = j.batch_id
LEFT JOIN results r ON r.job_id = j.id
"""
