"""PFlash: lossy prompt compression by a drafter's attention (speculative prefill).

    ids = compress_for_request(engine, prompt_ids, request, telemetry)   # Engine.compress calls it

The engine owns its `PromptCompressor` (`engine.compressor`: park strategy, constants, test
hooks); replace it to configure PFlash for that engine.

One compressing job: the gate checks the options; a prompt under the threshold (mode auto) is
left alone with a note; otherwise the drafter is loaded beside (or instead of) the target
(engine.residency), scores every prompt token (scoring), the kept chunks are chosen
(selection) and mapped back to target tokens through text (bridge). Telemetry gets the
residency timings, `compress_tokens_before`, `compress_drafter_tokens_kept`, `compress_s`, and
the effective prompt is what the engine prefills.

With no `drafter_path` the target's own checkpoint drafts ("self-drafting"): correct and what
the tests use, but a small drafter of the same family is the point of PFlash.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

from batchd.engine.architectures import GGUF_ARCHITECTURES, HF_ARCHITECTURE_NAMES
from batchd.engine.capabilities import check_compression
from batchd.engine.checkpoint.gguf_file import read_gguf
from batchd.engine.errors import CheckpointError, UnsupportedFeatureError
from batchd.engine.pflash.bridge import INSTRUCTION_TOKENS, MIN_INSTRUCTION_KEPT, DrafterView, drafter_view, target_ids_after
from batchd.engine.pflash.scoring import TAIL_ROWS, PaddedScorer, score_prompt
from batchd.engine.pflash.selection import SelectionParams, Selection, select_chunks
from batchd.engine.pflash.window import DEFAULT_SCORING_WINDOW, ScoringWindow
from batchd.engine.drafter_names import file_identity
from batchd.engine.residency import Drafter, Residency
from batchd.engine.types import CompressionOptions, GenerationRequest, Telemetry

PADDED_SCORING_MAX = 32768   # drafter tokens: longer prompts keep the chunked path (no graph per length)

__all__ = ["PromptCompressor", "CompressionReport", "ScoringWindow", "DEFAULT_SCORING_WINDOW", "compress_for_request",
           "compress_requests", "CompressJob", "Compressed", "check_compression_options", "drafter_architecture",
           "ensure_target_resident", "default_scoring_chunk"]


@dataclass
class CompressionReport:
    tokens_before: int
    drafter_tokens: int
    drafter_tokens_kept: int
    tokens_after: int
    instruction_reappended: bool
    seconds: float
    selection: Optional[Selection] = None
    view: Optional[DrafterView] = None  # the drafter's tokens and, across tokenizers, the text
    drafter_path: str = ""
    drafter_sha256: str = ""  # for the job's configuration fingerprint
    windowed_scoring: bool = False  # the drafter's prefill used the scoring window (engine.pflash.window)


@dataclass
class CompressJob:
    prompt_ids: list[int]
    options: CompressionOptions
    telemetry: Telemetry


@dataclass
class Compressed:
    ids: list[int]            # the effective target prompt
    drafter_sha256: str       # the drafter checkpoint's hash (its "#layers=N" view suffix dropped); "": not compressed


def share_visit(telemetry: Telemetry, visit: Telemetry, jobs: int) -> None:
    """A job's share of a drafter visit that served `jobs` jobs: an equal part of its load,
    park and unpark seconds, its peak memory and its notes."""
    telemetry.drafter_load_s += visit.drafter_load_s / jobs
    telemetry.park_s += visit.park_s / jobs
    telemetry.unpark_s += visit.unpark_s / jobs
    telemetry.peak_device_memory_bytes = visit.peak_device_memory_bytes
    telemetry.notes += visit.notes
    if jobs > 1:
        telemetry.notes.append(f"PFlash: one drafter visit for {jobs} jobs waiting together; "
                               "load, park and unpark seconds are this job's share")


class PromptCompressor:
    """The PFlash pipeline for one engine: every docs/design.md constant is a parameter here or in
    `selection` (SelectionParams; its keep_ratio is replaced by each job's own). Drafter prompts
    longer than `scoring_window.exact_tokens` are scored with a windowed prefill
    (engine.pflash.window); `scoring_window=None` scores every length exactly."""

    def __init__(self, residency: Optional[Residency] = None, *, selection: SelectionParams = SelectionParams(),
                 tail_rows: int = TAIL_ROWS, instruction_tokens: int = INSTRUCTION_TOKENS,
                 min_instruction_kept: float = MIN_INSTRUCTION_KEPT, scoring_chunk: Optional[int] = None,
                 scoring_window: Optional[ScoringWindow] = DEFAULT_SCORING_WINDOW):
        self.residency = residency or Residency()
        self.selection, self.tail_rows = selection, tail_rows
        self.instruction_tokens, self.min_instruction_kept = instruction_tokens, min_instruction_kept
        self.scoring_chunk = scoring_chunk  # None: default_scoring_chunk(device)
        self.scoring_window = scoring_window  # None: exact scoring at every length
        self.last_report: Optional[CompressionReport] = None

    def compress(self, engine, prompt_ids: list[int], options: CompressionOptions, telemetry: Telemetry) -> list[int]:
        """One job: its effective target ids (raises the job's EngineError)."""
        [outcome] = self.compress_many(engine, [CompressJob(prompt_ids, options, telemetry)])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome.ids

    def compress_many(self, engine, jobs: list["CompressJob"]) -> list["Compressed | Exception"]:
        """Jobs waiting together, grouped by drafter checkpoint (file identity): each group is
        one drafter visit (one load, one park and unpark when the target must make room) that
        scores its jobs one after another. Each job's telemetry gets its own scoring and
        selection time and an equal share of the group's load, park and unpark. A drafter that
        cannot be loaded fails its group; a job whose scoring fails fails alone."""
        groups: dict[object, list[int]] = {}
        for i, job in enumerate(jobs):
            path = job.options.drafter_path or engine.checkpoint_path
            groups.setdefault(file_identity(path) or path, []).append(i)
        out: list = [None] * len(jobs)
        for indices in groups.values():
            for i, outcome in zip(indices, self._compress_group(engine, [jobs[i] for i in indices])):
                out[i] = outcome
        return out

    def _compress_group(self, engine, jobs: list["CompressJob"]) -> list["Compressed | Exception"]:
        started = time.perf_counter()
        drafter_path = jobs[0].options.drafter_path or engine.checkpoint_path
        chunk = self.scoring_chunk or default_scoring_chunk(engine.device)

        def score_all(drafter: Drafter) -> list:
            return [self._score_one(engine, drafter, job, chunk, drafter_path) for job in jobs]

        visit = Telemetry()   # the group's load, park and unpark, shared out below
        try:
            scored = self.residency.with_drafter(engine, drafter_path, score_all, visit, activation_rows=chunk,
                                                 prompt_tokens=max(len(job.prompt_ids) for job in jobs))
        except Exception as exc:  # noqa: BLE001 - with_drafter raises the group's EngineError
            scored = [exc] * len(jobs)
        # the visit's seconds that were no job's scoring (load, park, unpark), shared equally
        visit_share_s = (time.perf_counter() - started - sum(job.telemetry.scoring_s for job in jobs)) / len(jobs)
        out = []
        for job, outcome in zip(jobs, scored):
            share_visit(job.telemetry, visit, len(jobs))
            if isinstance(outcome, Exception):
                out.append(outcome)
                continue
            try:
                out.append(self._select(engine, job, *outcome, visit_share_s))
            except Exception as exc:  # noqa: BLE001 - a bug in one job's selection fails that job only
                out.append(exc)
        return out

    def _score_one(self, engine, drafter: Drafter, job: "CompressJob", chunk: int, drafter_path: str):
        """(view, scores, drafter sha256), or the job's error; out of memory fails the visit."""
        try:
            view = drafter_view(engine.codec, drafter.codec, job.prompt_ids, instruction_tokens=self.instruction_tokens)
            began = time.perf_counter()
            if self._graphed(drafter, len(view.ids)):
                if drafter.scorer is None:
                    drafter.scorer = PaddedScorer(drafter.model, tail_rows=self.tail_rows)
                scores = drafter.scorer.score(view.ids).cpu()
            else:
                scores = score_prompt(drafter.model, view.ids, tail_rows=self.tail_rows, prefill_chunk=chunk,
                                      window=self.scoring_window).cpu()
            job.telemetry.scoring_s += time.perf_counter() - began
            return view, scores, drafter.sha256
        except torch.OutOfMemoryError:
            raise   # the residency drops what it holds and fails the visit
        except Exception as exc:  # noqa: BLE001 - this job's error; the others still score
            return Residency.job_error(exc, drafter_path)

    def _select(self, engine, job: "CompressJob", view: DrafterView, scores, drafter_sha256: str,
                visit_share_s: float) -> "Compressed":
        started = time.perf_counter()
        prompt_ids, telemetry = job.prompt_ids, job.telemetry
        selection = select_chunks(view.ids, scores, replace(self.selection, keep_ratio=job.options.keep_ratio))
        ids, info = target_ids_after(view, selection.spans, engine.codec, prompt_ids,
                                     min_instruction_kept=self.min_instruction_kept)
        telemetry.compressed = True
        telemetry.compress_tokens_before = len(prompt_ids)
        telemetry.compress_drafter_tokens_kept = info.drafter_tokens_kept
        windowed = self.scoring_window is not None and self.scoring_window.applies(len(view.ids))
        if windowed:
            telemetry.notes.append(f"PFlash scored {len(view.ids)} drafter tokens with a windowed prefill "
                                   f"({self.scoring_window.describe()}; exact up to "
                                   f"{self.scoring_window.exact_tokens} tokens)")
        if info.instruction_reappended:
            telemetry.notes.append(f"PFlash kept {info.instruction_kept:.0%} of the final instruction; "
                                   "re-appended it whole")
        if len(ids) >= len(prompt_ids):
            telemetry.notes.append(f"PFlash kept all {len(prompt_ids)} prompt tokens: nothing was compressed")
        telemetry.compress_s = telemetry.scoring_s + visit_share_s + time.perf_counter() - started
        self.last_report = CompressionReport(len(prompt_ids), len(view.ids), info.drafter_tokens_kept, len(ids),
                                             info.instruction_reappended, telemetry.compress_s, selection, view,
                                             job.options.drafter_path or engine.checkpoint_path, drafter_sha256,
                                             windowed)
        return Compressed(ids, drafter_sha256.partition("#")[0])

    def _graphed(self, drafter: Drafter, tokens: int) -> bool:
        """CUDA prompts scored exactly in one padded forward (engine.pflash.scoring.PaddedScorer):
        longer than the tail, shorter than the windowed scoring's threshold. The CPU keeps the
        chunked path (no graphs to gain, and padding would cost it real work)."""
        exact = self.scoring_window is None or not self.scoring_window.applies(tokens)
        return drafter.model.device.type == "cuda" and exact and self.tail_rows < tokens <= PADDED_SCORING_MAX


def default_scoring_chunk(device) -> int:
    """Rows per drafter prefill forward. The first forward starts at row 0, where attention is
    plain causal (flash kernels, no mask), so one big chunk is fastest: on CUDA up to 128K rows
    (a 0.5B drafter's activations for 128K rows are a few GB); on the CPU 8K rows (measured
    twice as fast per token as 2K chunks, whose later chunks take a masked path)."""
    return 131072 if torch.device(device).type == "cuda" else 8192


def scoring_window_key(compressor: PromptCompressor) -> str:
    """How long prompts are scored, for a job's fingerprint: the window decides which chunks survive."""
    window = compressor.scoring_window
    return "exact" if window is None else f"w{window.window}-b{window.block}-s{window.sink}"


def ensure_target_resident(engine) -> None:
    """For the worker before any job: if an earlier job's restore failed and left the target
    parked, restore it now (raises TargetRestoreError if it still cannot)."""
    engine.compressor.residency.ensure_resident(engine)


def compress_for_request(engine, prompt_ids: list[int], request: GenerationRequest, telemetry: Telemetry) -> list[int]:
    """The effective target prompt ids for a job; fills the job's PFlash telemetry and sets
    `engine.compress_drafter_sha256` (the drafter's checkpoint hash, "" when not compressed), which
    the engine's fingerprint of the job names. Engine.compress and V4Engine.compress are this."""
    [outcome] = compress_requests(engine, [(prompt_ids, request, telemetry)])
    if isinstance(outcome, Exception):
        engine.compress_drafter_sha256 = ""
        raise outcome
    engine.compress_drafter_sha256 = outcome.drafter_sha256
    return outcome.ids


def compress_requests(engine, jobs: list[tuple[list[int], GenerationRequest, Telemetry]]) -> list["Compressed | Exception"]:
    """Jobs that arrived together: each one's `Compressed` (its ids unchanged when it is not
    compressed: mode off, or under the threshold in mode auto) or its error. The compressing
    ones share drafter visits (`PromptCompressor.compress_many`)."""
    out: list = [None] * len(jobs)
    waiting: dict[int, CompressJob] = {}
    for i, (prompt_ids, request, telemetry) in enumerate(jobs):
        options = request.compression
        try:
            telemetry.notes += check_compression_options(engine.config.architecture, str(engine.device), options,
                                                         engine.checkpoint_path)
        except Exception as exc:  # noqa: BLE001 - the gate's refusal is this job's error
            out[i] = exc
            continue
        if options.mode == "off":
            out[i] = Compressed(prompt_ids, "")
        elif options.mode == "auto" and len(prompt_ids) < options.threshold_tokens:
            telemetry.notes.append(f"not compressed: {len(prompt_ids)} tokens < threshold {options.threshold_tokens}")
            out[i] = Compressed(prompt_ids, "")
        else:
            waiting[i] = CompressJob(prompt_ids, options, telemetry)
    if waiting:
        for i, outcome in zip(waiting, engine.compressor.compress_many(engine, list(waiting.values()))):
            out[i] = outcome
    return out


def check_compression_options(target_architecture: str, device: str, options: CompressionOptions,
                              target_path: str = "") -> list[str]:
    """The feature gate for PFlash options, drafter included (for worker start and submit):
    raises UnsupportedFeatureError naming what cannot run; returns notes for no-op options."""
    if options.mode == "off":
        return check_compression(target_architecture, device, options)
    path = options.drafter_path or target_path
    if not path:
        raise UnsupportedFeatureError(f"--compress {options.mode} needs --compress-drafter PATH: this target was "
                                      "built without a checkpoint that could draft for itself")
    return check_compression(target_architecture, device, options, drafter_architecture=drafter_architecture(path),
                             self_drafting=not options.drafter_path, drafter_path=path)


def drafter_architecture(path: str) -> str:
    """The architecture a checkpoint declares, read without loading weights."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UnsupportedFeatureError(f"--compress-drafter {path}: no such file or folder; pass a Hugging Face "
                                      "model folder or a .gguf file")
    if p.is_dir():
        try:
            raw = json.loads((p / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{p / 'config.json'}: cannot be read ({err}); a drafter folder needs "
                                  "config.json") from None
        for name in raw.get("architectures") or []:
            if name in HF_ARCHITECTURE_NAMES:
                return HF_ARCHITECTURE_NAMES[name]
        return str(raw.get("model_type") or (raw.get("architectures") or ["unknown"])[0])
    arch = str(read_gguf(p).metadata.get("general.architecture", "unknown"))
    return GGUF_ARCHITECTURES.get(arch, arch)
