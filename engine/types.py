"""The engine's public request, result and telemetry types.

These are the contract between the engine and the service: the worker builds a
`GenerationRequest` from a job row and stores every field of `GenerationResult` and
`Telemetry` in SQL (docs/design.md section 2). Field names here are the column names there.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional

SpecMethod = Literal["none", "lookup", "draft"]
CompressMode = Literal["off", "auto", "always"]


@dataclass(frozen=True)
class SamplingParams:
    """temperature == 0 means greedy; top_k == 0 and top_p == 1.0 disable those filters."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SpeculationOptions:
    method: SpecMethod = "none"
    drafter_path: Optional[str] = None
    width: Optional[int] = None  # None: adaptive width from recent acceptance (1..16)


@dataclass(frozen=True)
class CompressionOptions:
    mode: CompressMode = "off"
    threshold_tokens: int = 4096  # prompts shorter than this (target tokens) are not compressed
    keep_ratio: float = 0.1
    drafter_path: Optional[str] = None


@dataclass(frozen=True)
class GenerationRequest:
    """One job. Exactly one of `prompt` and `messages` is set; `chat` applies the model's
    chat template to `prompt` (as one user message) or to `messages`. `continue_final_message`:
    the output continues the last message (a prefilled assistant answer) instead of opening a
    new assistant turn, as transformers' `apply_chat_template(continue_final_message=True)`."""

    prompt: Optional[str] = None
    messages: Optional[list[dict]] = None
    chat: bool = False
    continue_final_message: bool = False
    sampling: SamplingParams = field(default_factory=SamplingParams)
    speculation: SpeculationOptions = field(default_factory=SpeculationOptions)
    compression: CompressionOptions = field(default_factory=CompressionOptions)


@dataclass
class Telemetry:
    """Per-job timing and counters. Seconds are wall-clock on the worker; the service adds
    `queue_wait_s`, `worker_host` and the job's own total."""

    park_s: float = 0.0
    drafter_load_s: float = 0.0
    scoring_s: float = 0.0
    unpark_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0   # generated tokens after the first per decode second (TokenOutput)
    # speculation (zeros when off)
    spec_method: str = "none"
    spec_steps: int = 0
    spec_draft_tokens_offered: int = 0
    spec_draft_tokens_accepted: int = 0
    acceptance_rate: Optional[float] = None  # accepted draft tokens / offered
    mean_accepted_length: Optional[float] = None  # tokens per verify step, bonus token included
    acceptance_per_position: list[float] = field(default_factory=list)  # P(accept) at lane i
    draft_s: float = 0.0
    verify_s: float = 0.0
    spec_disabled: bool = False  # speculation switched itself off for this job
    spec_disabled_reason: Optional[str] = None
    # compression (PFlash)
    compressed: bool = False
    compress_tokens_before: Optional[int] = None
    compress_drafter_tokens_kept: Optional[int] = None
    compress_s: float = 0.0
    # the batch (engine.batch): seconds queued in the engine before the first step that ran the
    # job, against seconds from then to its end; the mean number of sequences per decode step
    # while it decoded; how often it was preempted (its blocks freed and recomputed)
    slot_wait_s: float = 0.0
    running_s: float = 0.0
    batch_size_mean: Optional[float] = None
    preemptions: int = 0
    # bytes of an unfinished UTF-8 character held back from the end of the text (engine.whole_chars)
    output_dropped_bytes: int = 0
    # device
    peak_device_memory_bytes: Optional[int] = None
    device: str = "cpu"
    notes: list[str] = field(default_factory=list)  # "accepted but had no effect" messages

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    output_sha256: str  # SHA-256 of text.encode("utf-8")
    token_ids_sha256: str  # SHA-256 of the generated ids as little-endian int32 bytes
    prompt_tokens: int
    effective_prompt_tokens: int  # after compression; == prompt_tokens when not compressed
    generated_tokens: int
    finish_reason: Literal["eos", "stop", "length"]
    telemetry: Telemetry
    fingerprint: dict  # target/drafter checkpoint sha256, dtype, kv dtype, sampling, spec, compression

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
