"""A job's `params` object: checked at submit and again in the worker (a row written by SQL
never passed through submit), then turned into an `engine.types.GenerationRequest`.

    {"max_new_tokens": 96, "temperature": 0, "chat": true, "spec": "lookup"}
"""
from __future__ import annotations

import math
from typing import Any, Optional

from batchd.engine.errors import BadInputError
from batchd.engine.drafter_names import check_drafter_name
from batchd.engine.types import CompressionOptions, GenerationRequest, SamplingParams, SpeculationOptions
from batchd.jobs.storable import json_problem, text_problem
from batchd.jobs.limits import check_integer_limits

# name -> (python types accepted, what a person should write)
PARAM_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "max_new_tokens": ((int,), "a positive integer"),
    "temperature": ((int, float), "a number >= 0 (0 is greedy)"),
    "top_k": ((int,), "an integer >= 0 (0 disables)"),
    "top_p": ((int, float), "a number in (0, 1]"),
    "seed": ((int,), "an integer"),
    "stop": ((list, str), "a string or a list of strings"),
    "ignore_eos": ((bool,), "true or false"),
    "chat": ((bool,), "true or false"),
    "continue_final_message": ((bool,), "true or false (continue the last message instead of opening a new turn)"),
    "spec": ((str,), "none, lookup or draft"),
    "drafter": ((str,), "a drafter name its workers serve ('#layers=N' for its first N layers)"),
    "spec_width": ((int,), "an integer from 1 to 16"),
    "compress": ((str,), "off, auto or always"),
    "compress_threshold": ((int,), "a positive integer (target tokens)"),
    "keep_ratio": ((int, float), "a number in (0, 1]"),
    "compress_drafter": ((str,), "a drafter name its workers serve"),
}
CHAT_ROLES = ("system", "user", "assistant")
SPEC_METHODS = ("none", "lookup", "draft")
COMPRESS_MODES = ("off", "auto", "always")
MAX_SEED = 2**63 - 1


def validate_params(params: Any, *, own_drafter: bool = False) -> dict[str, Any]:
    """The params with types checked and ranges enforced; raises BadInputError naming the key.
    `own_drafter`: the target is known to draft for itself (a DeepSeek V4 folder, whose MTP layer
    drafts), so spec='draft' needs no params.drafter."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise BadInputError(f"params must be a JSON object, got {type(params).__name__}")
    problem = json_problem(params, "params")
    if problem:
        raise BadInputError(problem)
    unknown = sorted(set(params) - set(PARAM_TYPES))
    if unknown:
        raise BadInputError(f"unknown param {', '.join(map(repr, unknown))}; known: {', '.join(PARAM_TYPES)}")
    clean: dict[str, Any] = {}
    for key, value in params.items():
        if value is None:
            continue
        types, expected = PARAM_TYPES[key]
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            raise BadInputError(f"param {key}={value!r}: expected {expected}")
        clean[key] = value
    _check_ranges(clean, own_drafter)
    check_integer_limits(clean)
    if isinstance(clean.get("stop"), str):
        clean["stop"] = [clean["stop"]]
    return clean


def _check_ranges(p: dict[str, Any], own_drafter: bool = False) -> None:
    def bad(key: str) -> BadInputError:
        return BadInputError(f"param {key}={p[key]!r}: expected {PARAM_TYPES[key][1]}")

    if "max_new_tokens" in p and p["max_new_tokens"] < 1:
        raise bad("max_new_tokens")
    if "temperature" in p and not (math.isfinite(p["temperature"]) and p["temperature"] >= 0):
        raise bad("temperature")
    if "top_k" in p and p["top_k"] < 0:
        raise bad("top_k")
    if "top_p" in p and not (0 < p["top_p"] <= 1):
        raise bad("top_p")
    if "seed" in p and not (0 <= p["seed"] <= MAX_SEED):
        raise BadInputError(f"param seed={p['seed']!r}: expected an integer from 0 to 2**63-1")
    if "stop" in p and isinstance(p["stop"], list) and not all(isinstance(s, str) and s for s in p["stop"]):
        raise bad("stop")
    if "spec" in p and p["spec"] not in SPEC_METHODS:
        raise bad("spec")
    if "spec_width" in p and not (1 <= p["spec_width"] <= 16):
        raise bad("spec_width")
    if "compress" in p and p["compress"] not in COMPRESS_MODES:
        raise bad("compress")
    if "compress_threshold" in p and p["compress_threshold"] < 1:
        raise bad("compress_threshold")
    if "keep_ratio" in p and not (0 < p["keep_ratio"] <= 1):
        raise bad("keep_ratio")
    if p.get("spec") == "draft" and not p.get("drafter") and not own_drafter:
        raise BadInputError("param spec='draft' needs a drafter checkpoint: set params.drafter")
    # names, never paths: the worker maps them to its own checkpoints (batchd.jobs.job_request)
    if "drafter" in p:
        check_drafter_name(p["drafter"], param="drafter")
    if "compress_drafter" in p:
        check_drafter_name(p["compress_drafter"], param="compress_drafter", layers_allowed=False)


def validate_input(prompt: Any, messages: Any, params: Optional[dict[str, Any]] = None) -> None:
    """Exactly one of a non-empty prompt string and a list of chat messages, each with a known
    role and text content; `params` (validated) for what depends on the input."""
    if (prompt is None) == (messages is None):
        raise BadInputError('give exactly one of "prompt" and "messages"')
    if prompt is not None:
        if not isinstance(prompt, str):
            raise BadInputError(f'"prompt" must be a string, got {type(prompt).__name__}')
        if not prompt.strip():
            raise BadInputError("the prompt is empty")
        if text_problem(prompt):
            raise BadInputError(f"the prompt {text_problem(prompt)}")
        if (params or {}).get("continue_final_message"):
            raise BadInputError("continue_final_message needs messages: it continues the last one")
        return
    if not isinstance(messages, list) or not messages:
        raise BadInputError('"messages" must be a non-empty list of {"role": ..., "content": ...}')
    problem = json_problem(messages, "messages")
    if problem:
        raise BadInputError(problem)
    for i, message in enumerate(messages):
        if (not isinstance(message, dict) or not isinstance(message.get("role"), str)
                or not isinstance(message.get("content"), str)):
            raise BadInputError(f'messages[{i}] must be {{"role": "<role>", "content": "<text>"}}')
        if message["role"] not in CHAT_ROLES:
            raise BadInputError(f"messages[{i}].role {message['role']!r} is not a chat role: "
                                f"use {', '.join(CHAT_ROLES[:-1])} or {CHAT_ROLES[-1]}")
    if not any(m["content"].strip() for m in messages):
        raise BadInputError("every message is empty")
    if (params or {}).get("continue_final_message") and not messages[-1]["content"].strip():
        raise BadInputError("continue_final_message: the last message is empty; give the text to continue")


def build_request(prompt: Optional[str], messages: Optional[list[dict]], params: dict[str, Any], *,
                  own_drafter: bool = False) -> GenerationRequest:
    p = validate_params(params, own_drafter=own_drafter)
    validate_input(prompt, messages, p)
    defaults = SamplingParams()
    sampling = SamplingParams(
        max_new_tokens=p.get("max_new_tokens", defaults.max_new_tokens),
        temperature=float(p.get("temperature", defaults.temperature)),
        top_k=p.get("top_k", defaults.top_k),
        top_p=float(p.get("top_p", defaults.top_p)),
        seed=p.get("seed"),
        stop=tuple(p.get("stop", ())),
        ignore_eos=p.get("ignore_eos", False),
    )
    speculation = SpeculationOptions(method=p.get("spec", "none"), drafter_path=p.get("drafter"),
                                     width=p.get("spec_width"))
    compress_defaults = CompressionOptions()
    compression = CompressionOptions(
        mode=p.get("compress", "off"),
        threshold_tokens=p.get("compress_threshold", compress_defaults.threshold_tokens),
        keep_ratio=float(p.get("keep_ratio", compress_defaults.keep_ratio)),
        drafter_path=p.get("compress_drafter"),
    )
    return GenerationRequest(prompt=prompt, messages=messages, chat=p.get("chat", False),
                             continue_final_message=p.get("continue_final_message", False), sampling=sampling,
                             speculation=speculation, compression=compression)
