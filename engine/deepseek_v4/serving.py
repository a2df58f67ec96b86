"""`V4Engine`: a DeepSeek V4 checkpoint as the worker's resident engine (what `Engine.load` returns
for a `deepseek_v4` folder).

It offers what the service uses of `engine.runtime.Engine` (`generate`, `generate_many`,
`batch_engine`, `fingerprint`, `warm_up`, `close`, the codec and the feature-gate notes), so
engine.batch.generate.BatchSession, the worker's engine loop and `batchd generate` run V4 jobs
unchanged: each request is encoded, queued in a `V4BatchEngine` (the batch scheduler over a paged
pool) and comes back as a GenerationResult with its hashes and telemetry. What the capability row
refuses (block-sparse attention, and `--spec draft` for a checkpoint without an MTP layer: its
MTP layer is its drafter, engine.deepseek_v4.mtp) is refused at start or for that job, with the
reason. PFlash compresses prompts as for any target (engine.pflash, text-level): a small dense
`--compress-drafter` scores them beside V4, resident; V4 is never parked to make room for it
(a drafter that does not fit fails its jobs with the out-of-memory reason).
"""
from __future__ import annotations

import json
import socket
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch

from batchd.engine.batch.generate import generate_many
from batchd.engine.capabilities import check_features
from batchd.engine.checkpoint.base import files_sha256
from batchd.engine.config import parse_dtype
from batchd.engine.checkpoint.hf import _read_tokenizer, _weight_files
from batchd.engine.deepseek_v4.batch import V4BatchEngine
from batchd.engine.deepseek_v4.model import load_folder
from batchd.engine.deepseek_v4.mtp import MTPLayer, build_mtp
from batchd.engine.errors import CheckpointError, EngineError, UnsupportedFeatureError
from batchd.engine.pflash import PromptCompressor, compress_for_request, compress_requests, scoring_window_key
from batchd.engine.residency import Residency
from batchd.engine.text import TextCodec
from batchd.engine.types import GenerationRequest, GenerationResult, Telemetry

ARCHITECTURE = "deepseek_v4"
DEFAULT_MAX_CONTEXT = 8192


def is_v4_folder(path) -> bool:
    """A Hugging Face folder whose config.json declares deepseek_v4."""
    config = Path(path).expanduser() / "config.json"
    if not config.is_file():
        return False
    try:
        raw = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # the ordinary loader reports a bad config.json
    return raw.get("model_type") == ARCHITECTURE or "DeepseekV4ForCausalLM" in (raw.get("architectures") or [])


class V4Engine:
    def __init__(self, model, codec: Optional[TextCodec], config, *, eos_ids: set[int], checkpoint_sha256: str = "",
                 checkpoint_path: str = "", notes: Optional[list[str]] = None, mtp: Optional[MTPLayer] = None):
        """`config`: an engine.runtime.EngineConfig; its device and dtype are the model's. `mtp`:
        the checkpoint's MTP layer, the drafter of `--spec draft` (None: refused for this target)."""
        self.model, self.codec, self.eos_ids, self.mtp = model, codec, set(eos_ids), mtp
        self.config = model.config
        self.device = model.device
        self.engine_config = config = replace(config, device=str(self.device),
                                              dtype=str(model.dtype).removeprefix("torch."),
                                              max_context=config.max_context or DEFAULT_MAX_CONTEXT)
        self.max_context, self.prefill_chunk = config.max_context, config.prefill_chunk
        self.checkpoint_sha256, self.checkpoint_path = checkpoint_sha256, checkpoint_path
        self.compress_drafter_sha256 = ""
        self.notes = list(notes or []) + check_features(ARCHITECTURE, self.device.type, attention=config.attention)
        if config.drafters:
            raise UnsupportedFeatureError("drafter checkpoints given for a deepseek_v4 target: it drafts with "
                                          "its own MTP layer (--spec draft), not a separate model")
        if self.device.type == "cuda" and config.cuda_graphs:
            self.notes.append("CUDA graphs requested: the deepseek_v4 path runs eagerly")
        self.compressor = PromptCompressor(Residency(park="never"))   # V4's pool and weights stay put
        self._batch: Optional[V4BatchEngine] = None

    @classmethod
    def load(cls, path, config) -> "V4Engine":
        """The V4 checkpoint folder at `path`, its tokenizer beside it."""
        folder = Path(path).expanduser()
        dtype = parse_dtype(config.dtype, config.device)
        model, aside = load_folder(folder, config.device, dtype)
        notes = aside.notes
        try:
            mtp = build_mtp(model, aside.mtp, str(folder))
        except CheckpointError as err:   # the target serves; only its drafter is unusable
            mtp, notes = None, [f"the checkpoint's MTP layer cannot be built, so --spec draft is refused: {err}"]
        tokenizer, (chat_template, template_source), bos, eos, _ = _read_tokenizer(folder, model.config)
        codec = TextCodec(tokenizer, chat_template, bos, eos, template_source=template_source)
        eos_ids = set(model.config.eos_token_ids) | ({codec.token_id(eos)} - {None})
        context = config.max_context or min(model.config.max_position_embeddings, DEFAULT_MAX_CONTEXT)
        sha = files_sha256(_weight_files(folder)[0])
        return cls(model, codec, replace(config, max_context=context), eos_ids=eos_ids, checkpoint_sha256=sha,
                   checkpoint_path=str(path), notes=notes, mtp=mtp)

    # ---- the job ---------------------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> GenerationResult:
        [(_, outcome)] = list(self.generate_many([request]))
        if isinstance(outcome, EngineError):
            raise outcome
        return outcome

    def generate_many(self, requests, **kwargs):
        """(index, GenerationResult or EngineError) as each finishes (engine.batch.generate)."""
        return generate_many(self, requests, **kwargs)

    def compress(self, prompt_ids: list[int], request: GenerationRequest, telemetry: Telemetry) -> list[int]:
        """PFlash when the job asks for it (engine.pflash); sets `compress_drafter_sha256`."""
        return compress_for_request(self, prompt_ids, request, telemetry)

    def compress_many(self, jobs: list[tuple[list[int], GenerationRequest, Telemetry]]) -> list:
        """Jobs that arrived together: each one's `engine.pflash.Compressed` or its error; the
        compressing ones share drafter visits."""
        return compress_requests(self, jobs)

    def fingerprint(self, request: GenerationRequest) -> dict:
        s, spec, comp = request.sampling, request.speculation, request.compression
        return {
            "target_sha256": self.checkpoint_sha256, "target_path": self.checkpoint_path,
            "dtype": str(self.model.dtype).removeprefix("torch."), "kv_dtype": str(self.model.dtype).removeprefix("torch."),
            "device": str(self.device), "host": socket.gethostname(), "temperature": s.temperature, "top_k": s.top_k,
            "top_p": s.top_p, "seed": s.seed, "max_new_tokens": s.max_new_tokens, "spec_method": spec.method,
            "spec_width": spec.width, "drafter_path": "mtp.0" if spec.method == "draft" else None,
            "compress": comp.mode, "keep_ratio": comp.keep_ratio if comp.mode != "off" else None,
            "scoring_window": scoring_window_key(self.compressor) if comp.mode != "off" else None,
            "attention": "dense", "decode_mlp": "moe-reference",
            "compress_drafter_sha256": self.compress_drafter_sha256 or None, "architecture": ARCHITECTURE,
        }

    def warm_up(self) -> float:
        """Nothing is compiled or captured on this path; -> 0 seconds."""
        return 0.0

    # ---- the batch engine ------------------------------------------------------------------

    def batch_engine(self, options=None) -> V4BatchEngine:
        """Built at first use: the pool holds eight sequences of the whole context (`options`:
        engine.batch.BatchOptions; its block_size, max_running and prefill_chunk are read)."""
        if self._batch is None or options is not None:
            block_size = options.block_size if options is not None else 16
            chunk = (options.prefill_chunk if options is not None and options.prefill_chunk else None) or 256
            chunk = max(block_size, chunk // block_size * block_size)
            self._batch = V4BatchEngine(self.model, max_context=self.max_context, eos_ids=self.eos_ids,
                                        block_size=block_size, chunk=chunk,
                                        max_running=options.max_running if options is not None else 64,
                                        decode_text=self.codec.decode if self.codec else None, mtp=self.mtp)
        return self._batch

    @property
    def batch(self) -> Optional[V4BatchEngine]:
        return self._batch

    def release_batch_engine(self) -> None:
        self._batch = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def close(self) -> None:
        self._batch = None
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def check_features_reason(option: str) -> str:
    from batchd.engine.capabilities import capabilities_for

    return capabilities_for(ARCHITECTURE).reason(option)

