"""What a batch report shows, read from the database: one row per job (its result's timing,
tokens, speculation and compression when it succeeded; its error when it failed) and the
batch's progress and totals (batchd.jobs.progress)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Optional

from sqlalchemy import select

from batchd.db.models import Job, Result
from batchd.db.session import read_scope
from batchd.jobs.progress import BatchProgress, batch_progress

JOB_COLUMNS = (Job.id, Job.custom_id, Job.status, Job.error_kind, Job.error_message, Job.created_at, Job.running_at,
               Job.succeeded_at, Job.failed_at)
RESULT_COLUMNS = (Result.queue_wait_s, Result.prefill_s, Result.decode_s, Result.total_s, Result.prompt_tokens,
                  Result.effective_prompt_tokens, Result.generated_tokens, Result.compressed,
                  Result.compression_ratio, Result.spec_method, Result.spec_steps, Result.acceptance_per_position,
                  Result.engine_started_at, Result.engine_finished_at)


@dataclass(frozen=True)
class ReportData:
    progress: BatchProgress
    jobs: list[dict[str, Any]]   # JOB_COLUMNS and RESULT_COLUMNS by name; result fields None without one

    @property
    def results(self) -> list[dict[str, Any]]:
        return [job for job in self.jobs if job["status"] == "succeeded" and job["generated_tokens"] is not None]

    @property
    def failures(self) -> list[dict[str, Any]]:
        return [job for job in self.jobs if job["status"] == "failed"]

    def values(self, column: str) -> list[float]:
        """A numeric result column over the succeeded jobs, NULLs left out."""
        return [float(job[column]) for job in self.results if job[column] is not None]


def report_data(url: str, batch: str) -> ReportData:
    progress = batch_progress(url, batch)   # raises UnknownBatch with the one-line message
    with read_scope(url) as session:
        rows = session.execute(select(*JOB_COLUMNS, *RESULT_COLUMNS).outerjoin(Result, Result.job_id == Job.id)
                               .where(Job.batch_id == progress.batch_id).order_by(Job.id)).mappings().all()
    return ReportData(progress=progress, jobs=[_plain(dict(row)) for row in rows])


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    row["status"] = str(row["status"].value if hasattr(row["status"], "value") else row["status"])
    positions = row.get("acceptance_per_position")
    if isinstance(positions, str):   # SQLite may hand JSON back as text
        row["acceptance_per_position"] = json.loads(positions)
    row["finished_at"] = _first(row["succeeded_at"], row["failed_at"])
    return row


def _first(*values: Optional[datetime]) -> Optional[datetime]:
    return next((value for value in values if value is not None), None)
