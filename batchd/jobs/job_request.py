"""A claimed job's row -> the engine's `GenerationRequest`, in the worker.

A row written by SQL never went through submit. The claim reads its `params` and `messages`
as text (batchd.jobs.lifecycle.CLAIMED_COLUMNS), parsed here, so a row whose JSON is broken
(SQLite stores any text in a JSON column) fails as that job's `bad_input` instead of breaking
every delivery of it. Then the params are checked as submit checks them (batchd.jobs.params)
and the drafters the job names are mapped to this worker's own checkpoints (its
`Settings.drafter_catalog()`): a job never names a path on the worker's host.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from batchd.config import Settings
from batchd.engine.drafter_names import DrafterCatalog
from batchd.engine.errors import BadInputError
from batchd.engine.types import GenerationRequest
from batchd.jobs.params import build_request


def request_for_job(settings: Settings, job) -> GenerationRequest:
    """The request of a claimed job (a row with prompt, messages and params); BadInputError
    for a row that cannot run, naming what is wrong."""
    params = stored_json(job.params, "params")
    messages = stored_json(job.messages, "messages")
    request = build_request(job.prompt, messages, {} if params is None else params)
    return resolve_drafters(request, catalog_for(settings))


def stored_json(value: Any, column: str) -> Any:
    """A JSON column read as text, parsed (a value already parsed is returned as it is)."""
    if not isinstance(value, (str, bytes)):
        return value
    try:
        return json.loads(value)
    except ValueError as exc:
        raise BadInputError(f"the job's {column} is not valid JSON ({exc}); write valid JSON to the row "
                            "(UPDATE jobs SET ...) and `batchd retry` it") from None
    except RecursionError:
        raise BadInputError(f"the job's {column} nests too deeply to read; flatten it") from None


def resolve_drafters(request: GenerationRequest, catalog: DrafterCatalog) -> GenerationRequest:
    """The request with its drafter names replaced by this worker's checkpoint paths."""
    speculation, compression = request.speculation, request.compression
    if speculation.drafter_path:
        speculation = dataclasses.replace(speculation, drafter_path=catalog.resolve(speculation.drafter_path))
    if compression.drafter_path:
        compression = dataclasses.replace(compression, drafter_path=catalog.resolve(
            compression.drafter_path, param="compress_drafter", layers_allowed=False))
    return dataclasses.replace(request, speculation=speculation, compression=compression)


@functools.lru_cache(maxsize=8)
def catalog_for(settings: Settings) -> DrafterCatalog:
    """One catalog per worker configuration (its paths are resolved once, at the first job)."""
    return settings.drafter_catalog()
