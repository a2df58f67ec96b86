"""`batchd export --format openai`: a batch's results as the output file of the OpenAI Batch API,
one line per finished job, so scripts written for that file read batchd's unchanged:

    {"id": "batchd-job-17", "custom_id": "request-1",
     "response": {"status_code": 200, "request_id": "batchd-job-17",
                  "body": {"id": "batchd-job-17", "object": "chat.completion", "created": 1764921600,
                           "model": "smollm2-135m",
                           "choices": [{"index": 0, "message": {"role": "assistant", "content": "..."},
                                        "logprobs": null, "finish_reason": "stop"}],
                           "usage": {"prompt_tokens": 22, "completion_tokens": 2, "total_tokens": 24},
                           "system_fingerprint": "<first 16 hex digits of the target's SHA-256>"}},
     "error": null}

A job with messages, or a prompt submitted with `chat`, answers as a chat completion
(`choices[0].message`); a plain prompt as a text completion (`choices[0].text`). A failed job
has a response with status 400 (its input: bad_input, too_long) or 500 (the rest) and the
error in its body, as the API reports a failed request; a cancelled or expired job has no
response and an `error` (`batch_cancelled`, `batch_expired`), as the API reports those.
Jobs not finished yet are left out (the API writes its file when the batch ends).
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import IO, Any, Iterable, Optional

# batchd's finish reasons -> the API's: the model's end of sequence and a stop string are both "stop"
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
REQUEST_ERRORS = ("bad_input", "too_long")   # the request's fault: HTTP 400, the rest 500
UNFINISHED = ("pending", "queued", "running")
ENDED_UNRUN = {"cancelled": "the job was cancelled (batchd cancel) before it finished",
               "expired": "the job waited past its deadline (--expires-in) before a worker started it"}


def openai_line(row: dict) -> Optional[dict]:
    """One `job_results` row as an output line; None for a job that has not finished."""
    status = row["status"]
    if status in UNFINISHED:
        return None
    request_id = f"batchd-job-{row['job_id']}"
    line: dict[str, Any] = {"id": request_id, "custom_id": row["custom_id"], "response": None, "error": None}
    if status == "succeeded":
        line["response"] = {"status_code": 200, "request_id": request_id, "body": _completion(row, request_id)}
    elif status == "failed":
        status_code = 400 if row["error_kind"] in REQUEST_ERRORS else 500
        kind = "invalid_request_error" if status_code == 400 else "server_error"
        line["response"] = {"status_code": status_code, "request_id": request_id, "body": {"error": {
            "message": row["error_message"], "type": kind, "param": None, "code": row["error_kind"]}}}
    else:
        line["error"] = {"code": f"batch_{status}", "message": ENDED_UNRUN[status]}
    return line


def _completion(row: dict, request_id: str) -> dict:
    choice: dict[str, Any] = {"index": 0}
    if _is_chat(row):
        choice["message"] = {"role": "assistant", "content": row["output_text"]}
        kind = "chat.completion"
    else:
        choice["text"] = row["output_text"]
        kind = "text_completion"
    choice.update(logprobs=None, finish_reason=FINISH_REASONS.get(row["finish_reason"], row["finish_reason"]))
    return {
        "id": request_id, "object": kind, "created": _unix_seconds(row["succeeded_at"]), "model": row["model"],
        "choices": [choice],
        "usage": {"prompt_tokens": row["prompt_tokens"], "completion_tokens": row["generated_tokens"],
                  "total_tokens": row["prompt_tokens"] + row["generated_tokens"]},
        "system_fingerprint": (row["target_sha256"] or "")[:16] or None,
    }


def _is_chat(row: dict) -> bool:
    params = row.get("params") or {}
    return row.get("messages") is not None or bool(params.get("chat"))


def _unix_seconds(at: Any) -> Optional[int]:
    if isinstance(at, str):
        at = datetime.fromisoformat(at)
    return int(at.timestamp()) if at is not None else None


def write_openai(rows: Iterable[dict], out: IO[str]) -> tuple[int, int]:
    """(lines written, unfinished jobs left out)."""
    written = left_out = 0
    for row in rows:
        line = openai_line(row)
        if line is None:
            left_out += 1
            continue
        out.write(json.dumps(line, ensure_ascii=False) + "\n")
        written += 1
    return written, left_out
