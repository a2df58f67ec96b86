"""Write a batch's jobs in bulk, then publish them after the commit.

A batch is named; submitting again under the same name adds only the custom_ids the batch
does not hold yet, so a re-run of the same command is idempotent. A custom_id the batch holds
with a different input is kept as it is and reported, unless `replace`: then the new input
replaces the old in every job that has not succeeded (the job runs again from `pending`; a
succeeded job is kept and reported). Invalid inputs become `failed` jobs with error_kind
`bad_input` and a message (the rest of the batch goes on); a custom_id given twice in one
submission is reported and the second one dropped.

Every input is read before anything is written, so a mistake in the arguments (a missing
file, a bad batch name) leaves no trace; a new batch is created in the transaction that
inserts its jobs. A failed row is made storable (`batchd.jobs.storable`) so that it cannot
cost the others their insert.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Iterable, NamedTuple, Optional

from sqlalchemy import Connection, bindparam, insert, select, text, update
from sqlalchemy.exc import IntegrityError

from batchd.config import MODEL_NAME_PATTERN, Settings
from batchd.db.models import Batch, Job, JobEvent, JobStatus
from batchd.db.session import db_engine, is_postgresql, one_statement
from batchd.db.types import utcnow
from batchd.jobs.inputs import MAX_CUSTOM_ID, InputError, JobInput, fit_custom_id
from batchd.jobs.params import validate_input, validate_params
from batchd.jobs.storable import scrubbed, scrubbed_text, text_problem
from batchd.queue.broker import BROKER_UNREACHABLE
from batchd.engine.errors import BadInputError

INSERT_CHUNK = 2000
MAX_BATCH_NAME = 255  # the column's width

JOBS, BATCHES, EVENTS = Job.__table__, Batch.__table__, JobEvent.__table__
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

BATCH_WITH_JOBS = (select(Batch.id, Job.id.label("job_id"), Job.custom_id, Job.input_sha256, Job.status)
                   .outerjoin(Job, Job.batch_id == Batch.id).where(Batch.name == bindparam("name")))

# Replace a job's input, unless it succeeded meanwhile (then it is kept: compare-and-swap)
REPLACED_FIELDS = ("model", "prompt", "messages", "params", "input_sha256", "status", "pending_at", "queued_at",
                   "failed_at", "expires_at", "lease_expires_at", "error_kind", "error_message", "retryable")
REPLACE_INPUT = (update(JOBS).where(JOBS.c.id == bindparam("job"), JOBS.c.status != JobStatus.SUCCEEDED)
                 .values(**{name: bindparam(f"new_{name}", type_=JOBS.c[name].type) for name in REPLACED_FIELDS},
                         running_at=None, succeeded_at=None, cancelled_at=None, expired_at=None, attempts=0,
                         worker_id=None)
                 .returning(JOBS.c.id))


class ExistingJob(NamedTuple):
    id: int
    input_sha256: Optional[str]
    status: JobStatus


@dataclass
class SubmitReport:
    batch_id: int
    batch_name: str
    batch_created: bool
    model: str = ""  # the model name jobs run on when they name none
    job_ids: list[int] = field(default_factory=list)  # valid jobs (pending/queued) inserted or replaced now
    new_jobs: int = 0  # of those, inserted
    already_present: int = 0  # custom_ids the batch held before (idempotent re-submit)
    changed_inputs: list[str] = field(default_factory=list)  # present with another input, kept (no `replace`)
    kept_succeeded: list[str] = field(default_factory=list)  # another input, kept: the job already succeeded
    replaced: list[tuple[str, str]] = field(default_factory=list)  # (custom_id, status it had): new input now
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (custom_id, message): failed at submit
    duplicates: list[tuple[str, str]] = field(default_factory=list)  # (source, message): not inserted
    ignored_models: Counter = field(default_factory=Counter)  # OpenAI body.model -> lines that named it
    published: int = 0
    unpublished_because: Optional[str] = None  # the broker could not be reached: the jobs wait as pending

    @property
    def inserted(self) -> int:
        return len(self.job_ids) + len(self.rejected)


def check_batch_name(name: Any) -> None:
    """A batch name the column holds; a person's mistake otherwise (one line)."""
    if not isinstance(name, str) or not name.strip():
        raise InputError("the batch name is empty: give --batch NAME")
    if len(name) > MAX_BATCH_NAME:
        raise InputError(f"the batch name has {len(name)} characters; give one of at most {MAX_BATCH_NAME}")
    if text_problem(name):
        raise InputError(f"the batch name {text_problem(name)}")


def existing_jobs(settings: Settings, name: str) -> tuple[Optional[int], dict[str, ExistingJob]]:
    """(batch id or None, its jobs by custom_id), read by one statement."""
    with one_statement(settings.database_url, read_only=True) as connection:
        rows = connection.execute(BATCH_WITH_JOBS, {"name": name}).all()
    if not rows:
        return None, {}
    return rows[0].id, {row.custom_id: ExistingJob(row.job_id, row.input_sha256, JobStatus(row.status))
                        for row in rows if row.custom_id is not None}


def submit_jobs(settings: Settings, batch_name: str, inputs: Iterable[JobInput], *,
                defaults: Optional[dict[str, Any]] = None, model: Optional[str] = None,
                expires_in_s: Optional[float] = None, publisher=None, replace: bool = False) -> SubmitReport:
    """Insert the inputs as jobs of `batch_name`. With a `publisher`, valid jobs are written as
    `queued` and their ids sent after the commit (back to `pending` if sending fails); without
    one they are written `pending` for the relay. `defaults` are params every job starts from.
    `replace`: a custom_id the batch holds with another input gets the new one (see above)."""
    check_batch_name(batch_name)
    inputs = list(inputs)  # every file and line read (a missing file raises) before anything is written
    if not inputs:
        raise InputError("nothing to submit: the inputs hold no jobs")
    defaults = validate_params(defaults or {})
    model = model or settings.model_name
    check_model_name(model)
    for attempt in range(2):
        batch_id, existing = existing_jobs(settings, batch_name)
        report = SubmitReport(batch_id=batch_id or 0, batch_name=batch_name, batch_created=batch_id is None,
                              model=model)
        plan = _plan(report, inputs, existing, replace, defaults, utcnow(), expires_in_s)
        if publisher is not None:
            _mark_for_publishing(settings, plan)
        try:
            ids = _write(settings, report, defaults, plan)
            break
        except IntegrityError:
            if attempt or not report.batch_created:
                raise
            # another submit created the batch in between: read it and plan again
    report.job_ids = list(ids.values())
    if publisher is not None and ids:
        try:
            publisher.send([(job_id, plan.rows[custom_id]["model"]) for custom_id, job_id in ids.items()])
        except BROKER_UNREACHABLE as exc:   # stored all the same: pending, for the relay to publish
            publisher.unmark(report.job_ids)
            report.unpublished_because = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return report
        except Exception:
            publisher.unmark(report.job_ids)
            raise
        report.published = len(ids)
    return report


@dataclass
class Plan:
    """What one submit writes: rows by custom_id; the new ones, and existing jobs whose input
    it replaces (custom_id -> (job id, status it had))."""

    rows: dict[str, dict] = field(default_factory=dict)
    new: list[str] = field(default_factory=list)
    replacing: dict[str, tuple[int, JobStatus]] = field(default_factory=dict)


def _plan(report: SubmitReport, inputs: list[JobInput], existing: dict[str, ExistingJob], replace: bool,
          defaults: dict, now: datetime, expires_in_s: Optional[float]) -> Plan:
    plan = Plan()
    expires_at = now + timedelta(seconds=expires_in_s) if expires_in_s else None
    seen: dict[str, str] = {}
    for job in inputs:
        job = _with_storable_custom_id(job)
        if job.custom_id in seen:
            report.duplicates.append((job.source, f"duplicate custom_id {job.custom_id!r} (first at {seen[job.custom_id]}); "
                                                  "this one was not submitted"))
            continue
        seen[job.custom_id] = job.source
        if job.requested_model is not None:
            report.ignored_models[job.requested_model] += 1
        held = existing.get(job.custom_id)
        if held is not None:
            report.already_present += 1
            if held.input_sha256 in (None, job.input_sha256):
                continue
            if not replace:
                report.changed_inputs.append(job.custom_id)
                continue
            if held.status == JobStatus.SUCCEEDED:
                report.kept_succeeded.append(job.custom_id)
                continue
            plan.replacing[job.custom_id] = (held.id, held.status)
        else:
            plan.new.append(job.custom_id)
        row, error = _job_row(job, report.model, defaults, now, expires_at)
        plan.rows[job.custom_id] = row
        if error:
            report.rejected.append((job.custom_id, error))
    return plan


def _with_storable_custom_id(job: JobInput) -> JobInput:
    """The job, or (a custom_id the database cannot hold) a failed job under a storable one."""
    problem = text_problem(job.custom_id) if isinstance(job.custom_id, str) else "is not a string"
    if problem is None and len(job.custom_id) <= MAX_CUSTOM_ID:
        return job
    problem = problem or f"has {len(job.custom_id)} characters (at most {MAX_CUSTOM_ID})"
    return JobInput(custom_id=fit_custom_id(scrubbed_text(str(job.custom_id))), source=job.source,
                    error=f"custom_id {problem}")


def _mark_for_publishing(settings: Settings, plan: Plan) -> None:
    now = utcnow()
    for row in plan.rows.values():
        if row["status"] == JobStatus.PENDING:
            row.update(status=JobStatus.QUEUED, queued_at=now,
                       lease_expires_at=now + timedelta(seconds=settings.queue_lease_s))


def _job_row(job: JobInput, default_model: str, defaults: dict, now: datetime,
             expires_at: Optional[datetime]) -> tuple[dict, Optional[str]]:
    row = {"custom_id": job.custom_id, "model": job.model or default_model,
           "prompt": job.prompt if isinstance(job.prompt, str) else None,
           "messages": job.messages if isinstance(job.messages, list) else None,
           "params": {**defaults, **(job.params or {})}, "input_sha256": job.input_sha256,
           "status": JobStatus.PENDING, "created_at": now, "pending_at": now, "queued_at": None, "failed_at": None,
           "expires_at": expires_at, "lease_expires_at": None, "attempts": 0, "error_kind": None,
           "error_message": None, "retryable": None}
    error = job.error
    if error is None:
        try:
            row["params"] = validate_params(row["params"])
            validate_input(job.prompt, job.messages, row["params"])
            check_model_name(row["model"])
        except BadInputError as exc:
            error = exc.message
    if error is not None:
        _make_storable(row, default_model)
        error = scrubbed_text(error)
        row.update(status=JobStatus.FAILED, failed_at=now, error_kind="bad_input", error_message=error,
                   retryable=False)
    return row, error


def _make_storable(row: dict, default_model: str) -> None:
    """A failed row keeps what was sent where the database can hold it: NUL characters and lone
    surrogates become U+FFFD, a value nested too deep is dropped, and exactly one of prompt and
    messages is set (an empty prompt when neither could be kept)."""
    row["prompt"] = scrubbed_text(row["prompt"]) if row["prompt"] is not None else None
    row["messages"] = scrubbed(row["messages"])
    if (row["prompt"] is None) == (row["messages"] is None):
        row["prompt"], row["messages"] = row["prompt"] or "", None
    if not isinstance(row["model"], str) or not MODEL_NAME_PATTERN.match(row["model"]):
        row["model"] = default_model
    params = scrubbed(row["params"]) if isinstance(row["params"], dict) else None
    row["params"] = params if isinstance(params, dict) else {}


def check_model_name(model: object) -> None:
    """A job names a model served by some worker; a checkpoint path is a person's likely mistake."""
    if isinstance(model, str) and ("/" in model or model.endswith((".gguf", ".safetensors"))):
        where = "" if Path(model).exists() else " (and nothing exists there)"
        raise BadInputError(f"unknown model {model!r}{where}: a job names a model by the name its workers serve "
                            "(`batchd worker --model PATH --model-name NAME`), not by path")
    if not isinstance(model, str) or not MODEL_NAME_PATTERN.match(model):
        raise BadInputError(f"model {model!r} is not a model name (letters, digits, '.', '_', '-')")


def _write(settings: Settings, report: SubmitReport, defaults: dict, plan: Plan) -> dict[str, int]:
    """Create the batch if it is new, INSERT the new jobs with one event each (`submitted`, or
    `rejected` for a failed row) and replace the inputs of `plan.replacing`, all in one
    transaction; the ids of the valid (pending or queued) jobs by custom_id, new ones first."""
    url = settings.database_url
    new_rows = [plan.rows[custom_id] for custom_id in plan.new]
    chunks = [new_rows[start:start + INSERT_CHUNK] for start in range(0, len(new_rows), INSERT_CHUNK)]
    # an existing batch and one chunk: one statement, no BEGIN or COMMIT round trip (PostgreSQL)
    single = not report.batch_created and len(chunks) <= 1 and not plan.replacing
    with (one_statement(url) if single else db_engine(url).begin()) as connection:
        if report.batch_created:
            report.batch_id = connection.execute(
                insert(BATCHES).values(name=report.batch_name, model=report.model, params=defaults)
                .returning(BATCHES.c.id)).scalar_one()
        ids: dict[str, int] = {}
        for chunk in chunks:
            ids.update(_insert_chunk(connection, url, [{**row, "batch_id": report.batch_id} for row in chunk]))
        replaced = _replace_inputs(connection, plan)
    valid = {c: ids[c] for c in plan.new if plan.rows[c]["status"] != JobStatus.FAILED}
    report.new_jobs = len(valid)
    valid.update({c: job_id for c, job_id in replaced.items() if plan.rows[c]["status"] != JobStatus.FAILED})
    report.replaced = [(c, plan.replacing[c][1].value) for c in replaced]
    lost = set(plan.replacing) - set(replaced)   # succeeded meanwhile: kept
    report.kept_succeeded += sorted(lost)
    report.rejected = [(c, message) for c, message in report.rejected if c not in lost]
    return valid


def _insert_chunk(connection: Connection, url: str, chunk: list[dict]) -> dict[str, int]:
    rows = [{name: row.get(name) for name in JOB_COLUMNS} for row in chunk]
    if is_postgresql(url):
        rows_json = json.dumps(rows, default=datetime.isoformat, ensure_ascii=False)
        return dict(connection.execute(INSERT_JOBS_WITH_EVENTS, {"rows": rows_json}).all())
    new = connection.execute(insert(JOBS).returning(JOBS.c.custom_id, JOBS.c.id, JOBS.c.status, JOBS.c.error_message),
                             rows).all()
    connection.execute(insert(EVENTS), [
        {"job_id": job.id, "event": "rejected" if job.status == JobStatus.FAILED else "submitted",
         "detail": job.error_message or job.status.value} for job in new])
    return {job.custom_id: job.id for job in new}


def _replace_inputs(connection: Connection, plan: Plan) -> dict[str, int]:
    """The new input into each job of `plan.replacing` that has not succeeded; with an event
    that says what it was. The ids of the jobs replaced, by custom_id."""
    replaced: dict[str, int] = {}
    for custom_id, (job_id, status) in plan.replacing.items():
        row = plan.rows[custom_id]
        values = {f"new_{name}": row[name] for name in REPLACED_FIELDS}
        if connection.execute(REPLACE_INPUT, {"job": job_id, **values}).first() is None:
            continue
        replaced[custom_id] = job_id
        detail = f"new input (the job was {status.value})"
        if row["status"] == JobStatus.FAILED:
            detail += f"; rejected: {row['error_message']}"
        connection.execute(insert(EVENTS), {"job_id": job_id, "event": "replaced", "detail": detail,
                                            "at": row["pending_at"]})
    return replaced
