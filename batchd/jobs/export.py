"""Rows for `batchd results` / `batchd export`: one per job, its result and telemetry when it
succeeded, its error when it failed. Read from the `job_results` view, the same one an
analyst queries."""
from __future__ import annotations

import csv
import json
from datetime import datetime
from typing import IO, Iterator, Optional

from sqlalchemy import text

from batchd.db.session import read_scope

EXPORT_COLUMNS_FIRST = ("custom_id", "status", "output_text", "output_sha256", "error_kind", "error_message")
JSON_COLUMNS = ("messages", "params", "acceptance_per_position", "notes")


def result_rows(url: str, batch: str, statuses: Optional[list[str]] = None) -> Iterator[dict]:
    query = "SELECT * FROM job_results WHERE batch = :batch"
    params: dict = {"batch": batch}
    if statuses:
        query += " AND status IN :statuses"
    query += " ORDER BY job_id"
    statement = text(query)
    if statuses:
        from sqlalchemy import bindparam

        statement = statement.bindparams(bindparam("statuses", expanding=True))
        params["statuses"] = statuses
    with read_scope(url) as session:
        for row in session.execute(statement, params).mappings():
            yield _plain(dict(row))


def _plain(row: dict) -> dict:
    for key, value in row.items():
        if isinstance(value, datetime):
            row[key] = value.isoformat()
        elif isinstance(value, str) and key in JSON_COLUMNS and value[:1] in "[{":
            row[key] = json.loads(value)  # SQLite hands JSON back as text through a view
    return row


def ordered_columns(row: dict) -> list[str]:
    return list(EXPORT_COLUMNS_FIRST) + [k for k in row if k not in EXPORT_COLUMNS_FIRST]


def write_jsonl(rows: Iterator[dict], out: IO[str]) -> int:
    n = 0
    for row in rows:
        out.write(json.dumps({k: row[k] for k in ordered_columns(row)}, ensure_ascii=False) + "\n")
        n += 1
    return n


def write_csv(rows: Iterator[dict], out: IO[str]) -> int:
    writer, n = None, 0
    for row in rows:
        if writer is None:
            writer = csv.DictWriter(out, fieldnames=ordered_columns(row))
            writer.writeheader()
        writer.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in row.items()})
        n += 1
    return n
