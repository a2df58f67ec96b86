"""What a person submits, read into `JobInput`s: files, folders, globs, stdin and JSONL.

A document file becomes one job whose prompt is the template with the file's text in it. A
JSONL line is one job in the style of batch APIs:

    {"custom_id": "doc-1", "prompt": "...", "params": {"max_new_tokens": 64}}
    {"custom_id": "doc-2", "messages": [{"role": "user", "content": "..."}]}

A bad file or line does not stop the others: it becomes a JobInput with `error` set, which
submit records as a failed job (bad_input) so the person finds it in the results.
"""
from __future__ import annotations

import glob
import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Optional

DEFAULT_TEMPLATE = "{document}"
BINARY_SNIFF_BYTES = 8192


class InputError(Exception):
    """A mistake in the arguments themselves (a path that does not exist): stops the submit."""


@dataclass
class JobInput:
    custom_id: str
    source: str  # where it came from, for messages: "docs/a.txt", "jobs.jsonl:3"
    prompt: Optional[str] = None
    messages: Optional[list[Any]] = None
    params: dict[str, Any] = field(default_factory=dict)
    model: Optional[str] = None
    error: Optional[str] = None  # set: the input is unusable and becomes a failed job

    @property
    def input_sha256(self) -> str:
        payload = {"prompt": self.prompt, "messages": self.messages, "params": self.params, "model": self.model}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()


def read_inputs(args: list[str], *, template: str = DEFAULT_TEMPLATE, fmt: str = "auto",
                stdin: Optional[BinaryIO] = None) -> Iterator[JobInput]:
    """Jobs from each argument in order: '-' (stdin), a file, a folder (recursively) or a glob."""
    if "{document}" not in template:
        raise InputError("the template must contain {document} where the file's text goes")
    for arg in args:
        if arg == "-":
            data = (stdin or sys.stdin.buffer).read()
            yield from _from_bytes(data, "stdin", "stdin", template, fmt)
            continue
        for path in _expand(arg):
            fmt_here = "jsonl" if fmt == "auto" and path.suffix == ".jsonl" else fmt
            custom_id = path.as_posix()
            yield from _from_bytes(path.read_bytes(), custom_id, path.as_posix(), template, fmt_here)


def _expand(arg: str) -> list[Path]:
    if any(ch in arg for ch in "*?["):
        matches = sorted(Path(p) for p in glob.glob(arg, recursive=True))
        files = [p for p in matches if p.is_file()]
        if not files:
            raise InputError(f"no files match {arg!r}")
        return files
    path = Path(arg)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*")
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise InputError(f"folder {arg!r} holds no files")
        return files
    if not path.exists():
        raise InputError(f"no such file or folder: {arg!r}")
    return [path]


def _from_bytes(data: bytes, custom_id: str, source: str, template: str, fmt: str) -> Iterator[JobInput]:
    if fmt == "auto" and source == "stdin":
        fmt = "jsonl" if data.lstrip()[:1] == b"{" else "text"
    if fmt == "jsonl":
        text, error = decode_text(data)
        if error:
            yield JobInput(custom_id=custom_id, source=source, error=error)
            return
        yield from parse_jsonl(text, source)
        return
    text, error = decode_text(data)
    if error:
        yield JobInput(custom_id=custom_id, source=source, error=error)
        return
    yield JobInput(custom_id=custom_id, source=source, prompt=template.replace("{document}", text))


def decode_text(data: bytes) -> tuple[str, Optional[str]]:
    """The text, or an error message for an empty, binary or non-UTF-8 file."""
    if not data.strip():
        return "", "empty file: nothing to generate from"
    if b"\x00" in data[:BINARY_SNIFF_BYTES]:
        return "", "binary file (it contains NUL bytes): give UTF-8 text"
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError as exc:
        return "", f"not valid UTF-8 (byte {exc.start}: {data[exc.start:exc.start + 1]!r}): convert the file to UTF-8"


def parse_jsonl(text: str, source: str) -> Iterator[JobInput]:
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            yield JobInput(custom_id=where, source=where, error=f"line {lineno}: not valid JSON ({exc.msg})")
            continue
        yield _job_from_object(obj, where)


def _job_from_object(obj: Any, where: str) -> JobInput:
    if not isinstance(obj, dict):
        return JobInput(custom_id=where, source=where, error="each line must be a JSON object")
    custom_id = obj.get("custom_id", where)
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 255:
        return JobInput(custom_id=where, source=where, error="custom_id must be a string of 1 to 255 characters")
    unknown = sorted(set(obj) - {"custom_id", "prompt", "messages", "params", "model"})
    job = JobInput(custom_id=custom_id, source=where, prompt=obj.get("prompt"), messages=obj.get("messages"),
                   model=obj.get("model"))
    if unknown:
        job.error = f"unknown key {', '.join(map(repr, unknown))}; use custom_id, prompt or messages, params, model"
    elif not isinstance(obj.get("params", {}), dict):
        job.error = "params must be a JSON object"
    else:
        job.params = obj.get("params") or {}
    if job.model is not None and not isinstance(job.model, str):
        job.error, job.model = "model must be a model name (a string)", None
    return job
