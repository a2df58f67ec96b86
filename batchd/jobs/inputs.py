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
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Optional

from batchd.jobs import openai_requests
from batchd.jobs.storable import UnstorableJson, loads_line

DEFAULT_TEMPLATE = "{document}"
BINARY_SNIFF_BYTES = 8192
MAX_CUSTOM_ID = 255  # the column's width
UTF8_BOM = "\ufeff"
NATIVE_KEYS = ("custom_id", "prompt", "messages", "params", "model")


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
    requested_model: Optional[str] = None  # an OpenAI line's body.model that maps to no batchd model

    @property
    def input_sha256(self) -> str:
        payload = {"prompt": self.prompt, "messages": self.messages, "params": self.params, "model": self.model}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()


def read_inputs(args: list[str], *, template: str = DEFAULT_TEMPLATE, fmt: str = "auto",
                stdin: Optional[BinaryIO] = None, model_aliases: Optional[dict[str, str]] = None) -> Iterator[JobInput]:
    """Jobs from each argument in order: '-' (stdin), a file, a folder (recursively) or a glob.
    `model_aliases` maps an OpenAI line's body.model onto a batchd model name."""
    if "{document}" not in template:
        raise InputError("the template must contain {document} where the file's text goes")
    aliases = model_aliases or {}
    for arg in args:
        if arg == "-":
            data = (stdin or sys.stdin.buffer).read()
            yield from _from_bytes(data, "stdin", "stdin", template, fmt, aliases)
            continue
        for path in _expand(arg):
            fmt_here = "jsonl" if fmt == "auto" and path.suffix == ".jsonl" else fmt
            yield from _from_bytes(path.read_bytes(), path_custom_id(path), path.as_posix(), template, fmt_here,
                                   aliases)


def path_custom_id(path: Path) -> str:
    """The custom_id of a file: its absolute path, folders resolved (the file itself is not: a
    symlink keeps its own name), with any byte of the name that is not UTF-8 written as \\xNN."""
    absolute = path.parent.resolve() / path.name
    return fit_custom_id(os.fsencode(absolute).decode("utf-8", "backslashreplace"))


def fit_custom_id(custom_id: str) -> str:
    """`custom_id` if it fits the column, else a stable shorter id: a hash of the whole, then
    its end (where a path's file name is)."""
    if len(custom_id) <= MAX_CUSTOM_ID:
        return custom_id
    digest = hashlib.sha256(custom_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{digest}…{custom_id[-(MAX_CUSTOM_ID - len(digest) - 1):]}"


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


def _from_bytes(data: bytes, custom_id: str, source: str, template: str, fmt: str,
                aliases: dict[str, str]) -> Iterator[JobInput]:
    if fmt == "auto" and source == "stdin":
        fmt = "jsonl" if data.removeprefix(UTF8_BOM.encode()).lstrip()[:1] == b"{" else "text"
    if fmt == "jsonl":
        text, error = decode_text(data)
        if error:
            yield JobInput(custom_id=custom_id, source=source, error=error)
            return
        yield from parse_jsonl(text, source, aliases)
        return
    text, error = decode_text(data)
    if error:
        yield JobInput(custom_id=custom_id, source=source, error=error)
        return
    yield JobInput(custom_id=custom_id, source=source, prompt=template.replace("{document}", text))


def decode_text(data: bytes) -> tuple[str, Optional[str]]:
    """The text (without a leading UTF-8 byte order mark), or an error message for an empty,
    binary or non-UTF-8 file."""
    if not data.strip():
        return "", "empty file: nothing to generate from"
    if b"\x00" in data[:BINARY_SNIFF_BYTES]:
        return "", "binary file (it contains NUL bytes): give UTF-8 text"
    try:
        text = data.decode("utf-8").removeprefix(UTF8_BOM)
    except UnicodeDecodeError as exc:
        return "", f"not valid UTF-8 (byte {exc.start}: {data[exc.start:exc.start + 1]!r}): convert the file to UTF-8"
    if not text.strip():
        return "", "empty file: nothing to generate from"
    return text, None


def parse_jsonl(text: str, source: str, model_aliases: Optional[dict[str, str]] = None) -> Iterator[JobInput]:
    for lineno, line in enumerate(text.removeprefix(UTF8_BOM).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            obj = loads_line(line)
        except json.JSONDecodeError as exc:
            yield JobInput(custom_id=where, source=where, error=f"line {lineno}: not valid JSON ({exc.msg})")
            continue
        except UnstorableJson as exc:
            yield JobInput(custom_id=where, source=where, error=f"line {lineno}: {exc}")
            continue
        yield _job_from_object(obj, where, model_aliases or {})


def _job_from_object(obj: Any, where: str, aliases: dict[str, str]) -> JobInput:
    if not isinstance(obj, dict):
        return JobInput(custom_id=where, source=where, error="each line must be a JSON object")
    custom_id = obj.get("custom_id", where)
    if not isinstance(custom_id, str) or not custom_id.strip() or len(custom_id) > MAX_CUSTOM_ID:
        return JobInput(custom_id=where, source=where, error="custom_id must be a string of 1 to 255 characters")
    if openai_requests.is_openai_request(obj):
        return _job_from_request_line(obj, custom_id, where, aliases)
    unknown = sorted(set(obj) - set(NATIVE_KEYS))
    job = JobInput(custom_id=custom_id, source=where, prompt=obj.get("prompt"), messages=obj.get("messages"),
                   model=obj.get("model"))
    if unknown:
        job.error = (f"unknown key {', '.join(map(repr, unknown))}; use custom_id, prompt or messages, params, model "
                     "(or an OpenAI batch request line: custom_id, method, url, body)")
    elif not isinstance(obj.get("params", {}), dict):
        job.error = "params must be a JSON object"
    else:
        job.params = obj.get("params") or {}
    if job.model is not None and not isinstance(job.model, str):
        job.error, job.model = "model must be a model name (a string)", None
    return job


def _job_from_request_line(obj: dict, custom_id: str, where: str, aliases: dict[str, str]) -> JobInput:
    """An OpenAI / vLLM batch request line as a job (its body mapped onto params)."""
    try:
        fields = openai_requests.job_fields(obj)
    except openai_requests.RequestLineError as exc:
        return JobInput(custom_id=custom_id, source=where, error=str(exc))
    requested = fields["requested_model"]
    model = openai_requests.resolve_model(requested, aliases)
    return JobInput(custom_id=custom_id, source=where, prompt=fields.get("prompt"), messages=fields.get("messages"),
                    params=fields["params"], model=model,
                    requested_model=requested if model is None and isinstance(requested, str) else None)
