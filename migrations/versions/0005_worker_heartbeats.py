"""workers: one row per worker process with the model it serves and its last heartbeat, so that
`batchd status` can say which waiting jobs no live worker serves.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-07
"""
from __future__ import annotations

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: Union[str, None] = "0004"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("worker_id", sa.String(length=255), nullable=False),
        sa.Column("model", sa.String(length=64), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), server_default=sa.text("CURRENT_TIMESTAMP"), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), server_default=sa.text("CURRENT_TIMESTAMP"), nullable=False),
        sa.PrimaryKeyConstraint("worker_id", name=op.f("pk_workers")),
    )
    op.create_index(op.f("ix_workers_model"), "workers", ["model"])


def downgrade() -> None:
    op.drop_index(op.f("ix_workers_model"), table_name="workers")
    op.drop_table("workers")
