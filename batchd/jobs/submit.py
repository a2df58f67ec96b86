"""Write a batch's jobs in bulk, then publish them after the commit.

A batch is named; submitting again under the same name adds only the custom_ids the batch
does not hold yet, so a re-run of the same command is idempotent. Invalid inputs become
`failed` jobs with error_kind `bad_input` and a message (the rest of the batch goes on);
a custom_id given twice in one submission is reported and the second one dropped.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Iterable, Optional

from sqlalchemy import bindparam, insert, select, text
from sqlalchemy.exc import IntegrityError

from batchd.config import MODEL_NAME_PATTERN, Settings
from batchd.db.models import Batch, Job, JobEvent, JobStatus
from batchd.db.session import db_engine, is_postgresql, one_statement, session_scope
from batchd.db.types import utcnow
from batchd.jobs.inputs import JobInput
from batchd.jobs.params import validate_input, validate_params
from batchd.engine.errors import BadInputError

INSERT_CHUNK = 2000

JOBS = Job.__table__
JOB_COLUMNS = tuple(c.name for c in JOBS.columns if c.name != "id")

# PostgreSQL: a chunk of jobs (a JSON array of rows) and their events in one statement
INSERT_JOBS_WITH_EVENTS = text(f"""
    WITH new AS (
        INSERT INTO jobs ({", ".join(JOB_COLUMNS)})
        SELECT {", ".join(JOB_COLUMNS)} FROM json_populate_recordset(NULL::jobs, :rows)
        RETURNING custom_id, id, status, error_message),
    event AS (
        INSERT INTO job_events (job_id, event, detail)
        SELECT id, CASE WHEN status = 'failed' THEN 'rejected' ELSE 'submitted' END, coalesce(error_message, status)
        FROM new)
    SELECT custom_id, id FROM new""")

BATCH_WITH_JOBS = (select(Batch.id, Job.custom_id, Job.input_sha256)
                   .outerjoin(Job, Job.batch_id == Batch.id).where(Batch.name == bindparam("name")))


@dataclass
class SubmitReport:
    batch_id: int
    batch_name: str
    batch_created: bool
    job_ids: list[int] = field(default_factory=list)  # pending jobs inserted now
    already_present: int = 0  # custom_ids the batch held before (idempotent re-submit)
    changed_inputs: list[str] = field(default_factory=list)  # present, but with a different input now
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (custom_id, message): failed at submit
    duplicates: list[tuple[str, str]] = field(default_factory=list)  # (source, message): not inserted
    published: int = 0

    @property
    def inserted(self) -> int:
        return len(self.job_ids) + len(self.rejected)


def open_batch(settings: Settings, name: str, *, model: Optional[str],
               defaults: dict[str, Any]) -> tuple[int, bool, dict[str, Optional[str]]]:
    """(batch id, created?, its jobs' custom_id -> input_sha256): the batch and its jobs read by
    one statement, or the batch created. Two submitters racing on one name both end up with
    the same batch."""
    for _ in range(2):
        with one_statement(settings.database_url, read_only=True) as connection:
            rows = connection.execute(BATCH_WITH_JOBS, {"name": name}).all()
        if rows:
            return rows[0].id, False, {row.custom_id: row.input_sha256 for row in rows if row.custom_id is not None}
        try:
            with session_scope(settings.database_url) as session:
                batch = Batch(name=name, model=model, params=defaults)
                session.add(batch)
                session.flush()
                return batch.id, True, {}
        except IntegrityError:
            continue  # created by someone else in between: read it
    raise RuntimeError(f"could not create or find batch {name!r}")


def submit_jobs(settings: Settings, batch_name: str, inputs: Iterable[JobInput], *,
                defaults: Optional[dict[str, Any]] = None, model: Optional[str] = None,
                expires_in_s: Optional[float] = None, publisher=None) -> SubmitReport:
    """Insert the inputs as jobs of `batch_name`. With a `publisher`, valid jobs are written as
    `queued` and their ids sent after the commit (back to `pending` if sending fails); without
    one they are written `pending` for the relay. `defaults` are params every job starts from."""
    defaults = validate_params(defaults or {})
    model = model or settings.model_name
    batch_id, created, existing = open_batch(settings, batch_name, model=model, defaults=defaults)
    report = SubmitReport(batch_id=batch_id, batch_name=batch_name, batch_created=created)
    now = utcnow()
    expires_at = now + timedelta(seconds=expires_in_s) if expires_in_s else None
    seen: dict[str, str] = {}
    valid_rows, failed_rows = [], []
    for job in inputs:
        if job.custom_id in seen:
            report.duplicates.append((job.source, f"duplicate custom_id {job.custom_id!r} (first at {seen[job.custom_id]}); "
                                                  "this one was not submitted"))
            continue
        seen[job.custom_id] = job.source
        if job.custom_id in existing:
            report.already_present += 1
            if existing[job.custom_id] not in (None, job.input_sha256):
                report.changed_inputs.append(job.custom_id)
            continue
        row, error = _job_row(job, batch_id, model, defaults, now, expires_at)
        if error:
            failed_rows.append(row)
            report.rejected.append((job.custom_id, error))
        else:
            valid_rows.append(row)
    if publisher is not None:
        for row in valid_rows:
            row.update(status=JobStatus.QUEUED, queued_at=now,
                       lease_expires_at=now + timedelta(seconds=settings.queue_lease_s))
    report.job_ids = _insert_jobs(settings, valid_rows, failed_rows)
    if publisher is not None and report.job_ids:
        models = [row["model"] for row in valid_rows]
        try:
            publisher.send(list(zip(report.job_ids, models)))
        except Exception:
            publisher.unmark(report.job_ids)
            raise
        report.published = len(report.job_ids)
    return report


def _job_row(job: JobInput, batch_id: int, default_model: str, defaults: dict, now: datetime,
             expires_at: Optional[datetime]) -> tuple[dict, Optional[str]]:
    row = {"batch_id": batch_id, "custom_id": job.custom_id, "model": job.model or default_model,
           "prompt": job.prompt if isinstance(job.prompt, str) else None,
           "messages": job.messages if isinstance(job.messages, list) else None,
           "params": {**defaults, **(job.params or {})}, "input_sha256": job.input_sha256,
           "status": JobStatus.PENDING, "created_at": now, "pending_at": now, "expires_at": expires_at,
           "attempts": 0}
    error = job.error
    if error is None:
        try:
            validate_input(job.prompt, job.messages)
            row["params"] = validate_params(row["params"])
            check_model_name(row["model"])
        except BadInputError as exc:
            error = exc.message
    if error is not None:
        if (row["prompt"] is None) == (row["messages"] is None):
            row["prompt"], row["messages"] = row["prompt"] or "", None
        if not isinstance(row["model"], str) or not MODEL_NAME_PATTERN.match(row["model"]):
            row["model"] = default_model
        if not isinstance(row["params"], dict):
            row["params"] = {}
        row.update(status=JobStatus.FAILED, failed_at=now, error_kind="bad_input", error_message=error,
                   retryable=False)
    return row, error


def check_model_name(model: object) -> None:
    """A job names a model served by some worker; a checkpoint path is a person's likely mistake."""
    if isinstance(model, str) and ("/" in model or model.endswith((".gguf", ".safetensors"))):
        where = "" if Path(model).exists() else " (and nothing exists there)"
        raise BadInputError(f"unknown model {model!r}{where}: a job names a model by the name its workers serve "
                            "(`batchd worker --model PATH --model-name NAME`), not by path")
    if not isinstance(model, str) or not MODEL_NAME_PATTERN.match(model):
        raise BadInputError(f"model {model!r} is not a model name (letters, digits, '.', '_', '-')")


def _insert_jobs(settings: Settings, valid_rows: list[dict], failed_rows: list[dict]) -> list[int]:
    """INSERT the rows and one event per job (`submitted`, or `rejected` for a failed row), all
    in one transaction; the ids of the valid rows, in their order."""
    url = settings.database_url
    rows = [{name: row.get(name) for name in JOB_COLUMNS} for row in valid_rows + failed_rows]
    chunks = [rows[start:start + INSERT_CHUNK] for start in range(0, len(rows), INSERT_CHUNK)]
    ids: dict[str, int] = {}  # custom_id (unique in the batch) -> job id
    if is_postgresql(url):
        # one statement per chunk; one chunk needs no BEGIN or COMMIT round trip
        with (one_statement(url) if len(chunks) == 1 else db_engine(url).begin()) as connection:
            for chunk in chunks:
                rows_json = json.dumps(chunk, default=datetime.isoformat, ensure_ascii=False)
                ids.update(connection.execute(INSERT_JOBS_WITH_EVENTS, {"rows": rows_json}).all())
    else:
        with db_engine(url).begin() as connection:
            for chunk in chunks:
                new = connection.execute(insert(JOBS).returning(JOBS.c.custom_id, JOBS.c.id, JOBS.c.status,
                                                                JOBS.c.error_message), chunk).all()
                ids.update((job.custom_id, job.id) for job in new)
                connection.execute(insert(JobEvent.__table__), [
                    {"job_id": job.id, "event": "rejected" if job.status == JobStatus.FAILED else "submitted",
                     "detail": job.error_message or job.status.value} for job in new])
    return [ids[row["custom_id"]] for row in valid_rows]
