"""job_results carries each job's input (prompt or messages), params and input hash, and the
MLP kernel that decoded it (`decode_mlp`, until now only inside results.fingerprint).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-05
"""
from __future__ import annotations

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: Union[str, None] = "0002"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

# the fingerprint is a JSON column: each dialect reads a key its own way
DECODE_MLP_FROM_FINGERPRINT = {
    "postgresql": "UPDATE results SET decode_mlp = fingerprint->>'decode_mlp'",
    "sqlite": "UPDATE results SET decode_mlp = json_extract(fingerprint, '$.decode_mlp')",
}


def upgrade() -> None:
    with op.batch_alter_table("results") as table:   # SQLite rebuilds the table; PostgreSQL alters it
        table.add_column(sa.Column("decode_mlp", sa.String(16), nullable=True))
    op.execute(DECODE_MLP_FROM_FINGERPRINT[op.get_bind().dialect.name])
    op.execute("DROP VIEW job_results")
    op.execute(JOB_RESULTS_VIEW)


def downgrade() -> None:
    op.execute("DROP VIEW job_results")
    with op.batch_alter_table("results") as table:
        table.drop_column("decode_mlp")
    op.execute(JOB_RESULTS_VIEW.replace(INPUT_LINE, "").replace(DECODE_MLP, ""))   # 0002's view


INPUT_LINE = "    j.prompt, j.messages, j.params, j.input_sha256,\n"
DECODE_MLP = " r.decode_mlp,"
# 0002's view with the job's input after its timestamps and decode_mlp with the fingerprint columns
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
    r.slot_wait_s, r.running_s, r.batch_size_mean, r.preemptions,
    r.spec_method, r.spec_steps, r.spec_draft_tokens_offered, r.spec_draft_tokens_accepted,
    r.acceptance_rate, r.mean_accepted_length, r.acceptance_per_position, r.draft_s, r.verify_s,
    r.spec_disabled, r.spec_disabled_reason, r.compressed, r.compress_tokens_before,
    r.compress_drafter_tokens_kept, r.peak_device_memory_bytes, r.device, r.worker_host, r.notes,
    r.engine_started_at, r.engine_finished_at
FROM jobs j
JOIN batches b ON b.id = j.batch_id
LEFT JOIN results r ON r.job_id = j.id
"""
