"""SQLAlchemy models: batches, jobs, results, job_events, workers (docs/design.md sections 1 and 2).

A job moves pending -> queued -> running -> succeeded | failed | cancelled | expired, and each
state has its own timestamp column. Column names in `results` are the field names of
`engine.types.GenerationResult` and `engine.types.Telemetry`, so an analyst reads the same
names in SQL as in the engine's code. Migrations in migrations/ create exactly these tables
(a test compares them).
"""
from __future__ import annotations

import enum
from datetime import datetime
from typing import Any, Optional

from sqlalchemy import (JSON, BigInteger, CheckConstraint, Enum, ForeignKey, Index, Integer,
                        MetaData, String, Text, UniqueConstraint, func, text)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from batchd.db.types import UTCDateTime

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_N_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    # none_as_null: Python None is SQL NULL, not the JSON value null
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSON(none_as_null=True),
                           list[Any]: JSON(none_as_null=True)}


class JobStatus(enum.StrEnum):
    PENDING = "pending"  # written by submit or SQL INSERT, not yet on the queue
    QUEUED = "queued"  # published to the model's queue
    RUNNING = "running"  # claimed by a worker, which holds a lease
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"  # its deadline passed before a worker started it

    @property
    def timestamp_column(self) -> str:
        return f"{self.value}_at"


FINISHED = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.EXPIRED)
UNFINISHED = (JobStatus.PENDING, JobStatus.QUEUED, JobStatus.RUNNING)

ERROR_KINDS = ("bad_input", "too_long", "model_error", "oom", "timeout", "internal", "worker_lost")

job_status_type = Enum(JobStatus, name="job_status", native_enum=False, length=16, create_constraint=True,
                       values_callable=lambda statuses: [s.value for s in statuses], validate_strings=True)


class Batch(Base):
    __tablename__ = "batches"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    model: Mapped[Optional[str]] = mapped_column(String(64))  # default model name of its jobs
    params: Mapped[dict[str, Any]] = mapped_column(server_default=text("'{}'"))  # defaults given at submit
    created_at: Mapped[datetime] = mapped_column(server_default=func.current_timestamp())
    cancelled_at: Mapped[Optional[datetime]]

    jobs: Mapped[list["Job"]] = relationship(back_populates="batch", passive_deletes=True)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("batch_id", "custom_id"),
        Index("ix_jobs_status_lease_expires_at", "status", "lease_expires_at"),
        Index("ix_jobs_batch_id_status", "batch_id", "status"),
        CheckConstraint("attempts >= 0", name="attempts_not_negative"),
        CheckConstraint("(prompt IS NULL) <> (messages IS NULL)", name="prompt_xor_messages"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    batch_id: Mapped[int] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"))
    custom_id: Mapped[str] = mapped_column(String(255))
    model: Mapped[Optional[str]] = mapped_column(String(64))  # NULL: the relay's default model
    prompt: Mapped[Optional[str]] = mapped_column(Text)
    messages: Mapped[Optional[list[Any]]]
    params: Mapped[dict[str, Any]] = mapped_column(server_default=text("'{}'"))
    input_sha256: Mapped[Optional[str]] = mapped_column(String(64))  # of the input as submitted (retry keeps it)

    status: Mapped[JobStatus] = mapped_column(job_status_type, server_default=JobStatus.PENDING.value)
    created_at: Mapped[datetime] = mapped_column(server_default=func.current_timestamp())
    pending_at: Mapped[datetime] = mapped_column(server_default=func.current_timestamp())
    queued_at: Mapped[Optional[datetime]]
    running_at: Mapped[Optional[datetime]]
    succeeded_at: Mapped[Optional[datetime]]
    failed_at: Mapped[Optional[datetime]]
    cancelled_at: Mapped[Optional[datetime]]
    expired_at: Mapped[Optional[datetime]]
    expires_at: Mapped[Optional[datetime]]  # deadline to start; NULL: none

    attempts: Mapped[int] = mapped_column(server_default=text("0"))  # claims so far
    worker_id: Mapped[Optional[str]] = mapped_column(String(255))
    lease_expires_at: Mapped[Optional[datetime]]  # queued: republish after; running: worker presumed lost after
    error_kind: Mapped[Optional[str]] = mapped_column(String(32))
    error_message: Mapped[Optional[str]] = mapped_column(Text)
    retryable: Mapped[Optional[bool]]

    batch: Mapped[Batch] = relationship(back_populates="jobs")
    result: Mapped[Optional["Result"]] = relationship(back_populates="job", passive_deletes=True)


class Result(Base):
    """One row per succeeded job (the primary key is the job id: a job has at most one)."""

    __tablename__ = "results"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(server_default=func.current_timestamp())
    # output
    output_text: Mapped[str] = mapped_column(Text)
    output_sha256: Mapped[str] = mapped_column(String(64), index=True)  # SHA-256 of the UTF-8 output text
    token_ids_sha256: Mapped[str] = mapped_column(String(64))
    prompt_tokens: Mapped[int]
    effective_prompt_tokens: Mapped[int]  # after compression
    generated_tokens: Mapped[int]
    finish_reason: Mapped[str] = mapped_column(String(16))
    # configuration fingerprint
    target_sha256: Mapped[Optional[str]] = mapped_column(String(64))
    drafter_sha256: Mapped[Optional[str]] = mapped_column(String(64))
    drafter_path: Mapped[Optional[str]] = mapped_column(Text)
    dtype: Mapped[Optional[str]] = mapped_column(String(16))
    kv_dtype: Mapped[Optional[str]] = mapped_column(String(16))
    temperature: Mapped[Optional[float]]
    top_k: Mapped[Optional[int]]
    top_p: Mapped[Optional[float]]
    seed: Mapped[Optional[int]] = mapped_column(BigInteger)
    max_new_tokens: Mapped[Optional[int]]
    spec_width: Mapped[Optional[int]]
    compress_mode: Mapped[Optional[str]] = mapped_column(String(16))
    keep_ratio: Mapped[Optional[float]]
    compression_ratio: Mapped[Optional[float]]  # effective_prompt_tokens / prompt_tokens
    decode_mlp: Mapped[Optional[str]] = mapped_column(String(16))  # the MLP kernel that decoded: fused or chain
    fingerprint: Mapped[dict[str, Any]]  # the engine's whole fingerprint dict
    # telemetry: every field of engine.types.Telemetry
    park_s: Mapped[float]
    drafter_load_s: Mapped[float]
    scoring_s: Mapped[float]
    unpark_s: Mapped[float]
    prefill_s: Mapped[float]
    decode_s: Mapped[float]
    total_s: Mapped[float]
    prefill_tokens_per_s: Mapped[float]
    decode_tokens_per_s: Mapped[float]
    spec_method: Mapped[str] = mapped_column(String(16))
    spec_steps: Mapped[int]
    spec_draft_tokens_offered: Mapped[int]
    spec_draft_tokens_accepted: Mapped[int]
    acceptance_rate: Mapped[Optional[float]]  # accepted draft tokens / offered
    mean_accepted_length: Mapped[Optional[float]]  # tokens per verify step, bonus included
    acceptance_per_position: Mapped[list[Any]]
    draft_s: Mapped[float]
    verify_s: Mapped[float]
    spec_disabled: Mapped[bool]
    spec_disabled_reason: Mapped[Optional[str]] = mapped_column(Text)
    compressed: Mapped[bool]
    compress_tokens_before: Mapped[Optional[int]]
    compress_drafter_tokens_kept: Mapped[Optional[int]]
    compress_s: Mapped[float]
    slot_wait_s: Mapped[float] = mapped_column(server_default="0")  # in the engine, before its first step
    running_s: Mapped[float] = mapped_column(server_default="0")  # first step -> finished
    batch_size_mean: Mapped[Optional[float]]  # sequences per decode step while it decoded
    preemptions: Mapped[int] = mapped_column(server_default="0")
    output_dropped_bytes: Mapped[int] = mapped_column(server_default="0")  # an unfinished last character
    peak_device_memory_bytes: Mapped[Optional[int]] = mapped_column(BigInteger)
    device: Mapped[str] = mapped_column(String(64))
    notes: Mapped[list[Any]]
    # added by the service
    queue_wait_s: Mapped[Optional[float]]  # queued_at -> running_at
    worker_host: Mapped[str] = mapped_column(String(255))
    worker_id: Mapped[str] = mapped_column(String(255))
    engine_started_at: Mapped[datetime]
    engine_finished_at: Mapped[datetime]

    job: Mapped[Job] = relationship(back_populates="result")


class JobEvent(Base):
    """Append-only history of a job: every transition, publish and ignored delivery."""

    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(server_default=func.current_timestamp())
    event: Mapped[str] = mapped_column(String(32))
    worker_id: Mapped[Optional[str]] = mapped_column(String(255))
    detail: Mapped[Optional[str]] = mapped_column(Text)


class Worker(Base):
    """One row per worker process, beaten by its lease keeper: which model it serves and when it
    was last alive. `batchd status` reads it to say which waiting jobs no worker serves."""

    __tablename__ = "workers"

    worker_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    model: Mapped[str] = mapped_column(String(64), index=True)
    host: Mapped[str] = mapped_column(String(255))
    started_at: Mapped[datetime] = mapped_column(server_default=func.current_timestamp())
    last_seen_at: Mapped[datetime] = mapped_column(server_default=func.current_timestamp())
