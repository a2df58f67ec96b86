"""`Engine`: the resident model a worker keeps loaded, and the one call the service makes.

    engine = Engine.load("SmolLM2-135M-Instruct.Q4_1.gguf", EngineConfig(device="cpu"))
    result = engine.generate(GenerationRequest(prompt="...", chat=True))

The engine is configured by one `EngineConfig`. It owns the target model and the kernels it
runs (`engine.fused.KernelChoice`, chosen once for the device), its KV cache (allocated once for
`max_context` rows and reset per job), the text codec, the step runner (CUDA graphs on CUDA),
its speculative drafters (`drafters`) and its PFlash compressor with the drafter residency
(`compressor`, `residency`). Each job runs:
(1) validate and encode, (2) compress the prompt (PFlash, optional), (3) prefill and decode,
plainly or speculatively, (4) detokenise, cut stop strings, hash, collect telemetry.
"""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass, replace
from typing import Literal, Optional

import torch

from batchd.engine.batch import BatchEngine, BatchOptions, generate_many
from batchd.engine.capabilities import check_features
from batchd.engine.checkpoint import load_checkpoint
from batchd.engine.config import DTYPES, ModelConfig, parse_dtype  # noqa: F401 - DTYPES: re-exported
from batchd.engine.errors import BadInputError, DeviceOutOfMemoryError, EngineError, PromptTooLongError
from batchd.engine.fused import kernels_for
from batchd.engine.generate import TokenOutput, generate_plain, synchronize
from batchd.engine.hashes import sha256_hex, token_ids_sha256  # noqa: F401 (re-exported)
from batchd.engine.kv_cache import ContiguousKVCache, KVCache
from batchd.engine.model import Transformer, build_model, choose_fused_mlp, init_random  # noqa: F401 (re-exported)
from batchd.engine.pflash import (PromptCompressor, compress_for_request, compress_requests, ensure_target_resident,
                                  scoring_window_key)
from batchd.engine.residency import Residency
from batchd.engine.sampling import Sampler
from batchd.engine.speculative import Drafters, DraftTarget, generate_speculative
from batchd.engine.step import StepRunner
from batchd.engine.stopping import StopChecker
from batchd.engine.whole_chars import output_text
from batchd.engine.text import TextCodec
from batchd.engine.types import GenerationRequest, GenerationResult, SamplingParams, Telemetry

DEFAULT_MAX_CONTEXT = 8192


@dataclass(frozen=True)
class EngineConfig:
    """How an engine runs its model: everything but the model itself.

    device, dtype: where and in what the weights live (dtype None: bfloat16 on CUDA, float32 on
      the CPU; names as `parse_dtype` takes them). Read by `Engine.load` / `Engine.from_config`;
      an engine built around a model takes the model's.
    max_context: KV-cache rows, prompt plus output (None: the checkpoint's max_position_embeddings,
      at most 8192, for `load`; 8192 for `from_config` and a model handed to `Engine`).
    cuda_graphs: capture decode and verify steps as CUDA graphs (CUDA only).
    prefill_chunk: rows per prefill forward.
    attention: "dense", or "sparse" (top-k block sparse decode attention).
    sparse_top_k_blocks: blocks each decode step attends to with sparse attention.
    drafters: `drafter_path`s of draft models whose KV pools the batch engine sizes with its own
      (`BatchOptions.drafters`): on CUDA the target's pool takes most of the free memory, so a
      drafter not named here gets a pool only if there is room left when a job first asks for it.
    """

    device: str = "cpu"
    dtype: Optional[str] = None
    max_context: Optional[int] = None
    cuda_graphs: bool = True
    prefill_chunk: int = 2048
    attention: Literal["dense", "sparse"] = "dense"
    sparse_top_k_blocks: int = 64
    drafters: tuple[str, ...] = ()


class Engine:
    def __init__(self, model: Transformer, codec: Optional[TextCodec], config: EngineConfig = EngineConfig(), *,
                 eos_ids: frozenset[int] | set[int] = frozenset(), checkpoint_sha256: str = "",
                 checkpoint_path: str = ""):
        """An engine around a built model (`load` and `from_config` build one). `config.device`
        and `config.dtype` are the model's own; a missing `max_context` becomes 8192. The codec
        and the checkpoint's path and hash are fixed here: the drafters see them as given."""
        self.model = model
        self.config: ModelConfig = model.config
        self.device = model.device
        self.engine_config = config = replace(config, device=str(self.device),
                                              dtype=str(model.dtype).removeprefix("torch."),
                                              max_context=config.max_context or DEFAULT_MAX_CONTEXT)
        self.codec = codec
        self.eos_ids = set(eos_ids)
        self.checkpoint_sha256 = checkpoint_sha256
        self.checkpoint_path = checkpoint_path
        self.compress_drafter_sha256 = ""  # set per job by `compress`: the fingerprint names the drafter
        self.max_context = config.max_context
        self.prefill_chunk = config.prefill_chunk
        self.attention = config.attention
        # the kernels every model of this engine runs (target, drafters): one Triton kernel per
        # norm / rope / silu-mul and row-invariant projections on CUDA, the eager ops on the CPU
        model.use_ops(kernels_for(self.device))
        self.fused_mlp = choose_fused_mlp(model)  # recorded in the fingerprint
        self.notes = check_features(self.config.architecture, self.device.type, attention=config.attention,
                                    cuda_graphs=config.cuda_graphs, head_dim=self.config.head_dim)
        self.cache: KVCache = ContiguousKVCache(self.config, config.max_context, self.device, model.dtype)
        if config.attention == "sparse":
            self.cache.enable_sparse_attention(config.sparse_top_k_blocks)
        model.setup_rope(config.max_context)
        self.runner = StepRunner(model, self.cache, cuda_graphs=config.cuda_graphs)
        # speculative drafters, by drafter_path; they see the target's model and settings only
        self.drafters = Drafters(DraftTarget(model, codec, checkpoint_path, checkpoint_sha256, config.max_context,
                                             config.prefill_chunk, self.runner.cuda_graphs))
        # PFlash: replace `compressor` to configure it (park strategy, constants, test hooks)
        self.compressor = PromptCompressor(Residency())
        self._batch: Optional[BatchEngine] = None  # many jobs per step: `batch_engine`, built at first use

    @property
    def residency(self) -> Residency:
        """Where the PFlash drafter lives while it scores (parks and restores this engine's target)."""
        return self.compressor.residency

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str, config: EngineConfig = EngineConfig()) -> "Engine":
        """The checkpoint at `path` (a Hugging Face folder or a GGUF file) with its tokenizer. A
        DeepSeek V4 folder gets its own engine (engine.deepseek_v4.serving.V4Engine), which offers
        what the service uses of this one."""
        from batchd.engine.deepseek_v4.serving import V4Engine, is_v4_folder

        if is_v4_folder(path):
            return V4Engine.load(path, config)
        torch_dtype = parse_dtype(config.dtype, config.device)
        ckpt = load_checkpoint(path, dtype=torch_dtype)
        model = build_model(ckpt.config, config.device, torch_dtype, tensors=ckpt.tensors, source=str(path))
        codec = TextCodec(ckpt.tokenizer, ckpt.chat_template, ckpt.bos_token, ckpt.eos_token,
                          template_source=ckpt.chat_template_source)
        eos_ids = set(ckpt.config.eos_token_ids)
        eos_id = codec.token_id(ckpt.eos_token)
        if eos_id is not None:
            eos_ids.add(eos_id)
        context = config.max_context or min(ckpt.config.max_position_embeddings, DEFAULT_MAX_CONTEXT)
        return cls(model, codec, replace(config, max_context=context), eos_ids=eos_ids, checkpoint_sha256=ckpt.sha256,
                   checkpoint_path=str(path))

    @classmethod
    def from_config(cls, model_config: ModelConfig, config: EngineConfig = EngineConfig(), *, seed: int = 0,
                    codec: Optional[TextCodec] = None) -> "Engine":
        """Random weights at a real model's shape: for benchmarks, where speed does not depend
        on weight values. Token-id API only unless a codec is given."""
        torch_dtype = parse_dtype(config.dtype, config.device)
        model = build_model(model_config, config.device, torch_dtype, seed=seed)
        return cls(model, codec, replace(config, max_context=config.max_context or DEFAULT_MAX_CONTEXT),
                   eos_ids=set(model_config.eos_token_ids), checkpoint_sha256=f"random-seed-{seed}")

    # ---- the job ---------------------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> GenerationResult:
        """One request as a batch of one (engine.batch): its output is, bit for bit, what the same
        job gives beside any others in `generate_many` or a worker's batch, with or without
        speculation. Sparse attention, which the batch engine does not run, takes the
        one-sequence path (`generate_one`) and says so in the result's notes."""
        if self.codec is None:
            raise BadInputError("this engine was built without a tokenizer; use generate_ids")
        if self.attention == "sparse":
            result = self.generate_one(request)
            result.telemetry.notes.append("attention=sparse: ran on the one-sequence path, not the batch engine")
            return result
        spec = request.speculation
        if spec.method == "draft" and spec.drafter_path:
            self._size_batch_for_drafter(spec.drafter_path)
        [(_, outcome)] = list(self.generate_many([request]))
        if isinstance(outcome, EngineError):
            raise outcome
        return outcome

    def generate_one(self, request: GenerationRequest) -> GenerationResult:
        """The one-sequence path (engine.generate, engine.speculative): the batch-1 kernels, whose
        bits may differ from the batch engine's. What still needs it: sparse attention, and the
        batch-1 decode measurement (bench/decode.py, through `generate_ids`)."""
        started = time.perf_counter()
        if self.codec is None:
            raise BadInputError("this engine was built without a tokenizer; use generate_ids")
        telemetry = Telemetry(device=str(self.device), notes=list(self.notes))
        ensure_target_resident(self)  # an earlier job's failed unpark is retried before this one
        prompt_ids = self.codec.encode_request(request.prompt, request.messages, request.chat,
                                               request.continue_final_message)
        prompt_tokens = len(prompt_ids)
        effective_ids = self.compress(prompt_ids, request, telemetry)
        out = self.generate_ids(effective_ids, request, telemetry)
        text, telemetry.output_dropped_bytes = output_text(self.codec, out.token_ids, request.sampling.stop)
        telemetry.total_s = time.perf_counter() - started
        return GenerationResult(
            text=text, token_ids=out.token_ids, output_sha256=sha256_hex(text.encode("utf-8")),
            token_ids_sha256=token_ids_sha256(out.token_ids), prompt_tokens=prompt_tokens,
            effective_prompt_tokens=len(effective_ids), generated_tokens=len(out.token_ids),
            finish_reason=out.finish_reason, telemetry=telemetry, fingerprint=self.fingerprint(request),
        )

    def generate_ids(self, prompt_ids: list[int], request: GenerationRequest,
                     telemetry: Optional[Telemetry] = None) -> TokenOutput:
        """The token-id core: prompt ids in, generated ids out (no text)."""
        telemetry = telemetry if telemetry is not None else Telemetry(device=str(self.device))
        sampling = request.sampling
        sampler = Sampler(sampling, self.device)
        self.check_fits(len(prompt_ids), sampling.max_new_tokens)
        stopper = StopChecker(self.eos_ids, sampling.max_new_tokens, sampling.stop,
                              decode=self.codec.decode if self.codec else None, ignore_eos=sampling.ignore_eos)
        if self.device.type == "cuda" and telemetry.peak_device_memory_bytes is None:
            torch.cuda.reset_peak_memory_stats(self.device)  # else compression already opened the window
        self.cache.reset()
        try:
            out = self._decode(prompt_ids, request, sampler, stopper, telemetry)
        except torch.OutOfMemoryError as exc:
            self.cache.reset()
            raise DeviceOutOfMemoryError(f"out of device memory during generation: {exc}") from None
        telemetry.prefill_s, telemetry.decode_s = out.prefill_s, out.decode_s
        telemetry.prefill_tokens_per_s = len(prompt_ids) / out.prefill_s if out.prefill_s else 0.0
        telemetry.decode_tokens_per_s = out.decode_tokens_per_s
        if self.device.type == "cuda":
            telemetry.peak_device_memory_bytes = max(telemetry.peak_device_memory_bytes or 0,
                                                     torch.cuda.max_memory_allocated(self.device))
        return out

    def _decode(self, prompt_ids, request, sampler, stopper, telemetry) -> TokenOutput:
        spec = request.speculation
        if spec.method == "none":
            return generate_plain(self.runner, prompt_ids, sampler, stopper, prefill_chunk=self.prefill_chunk)
        telemetry.spec_method = spec.method
        return generate_speculative(self, prompt_ids, sampler, stopper, spec, telemetry)

    def compress_many(self, jobs: list[tuple[list[int], GenerationRequest, Telemetry]]) -> list:
        """Jobs that arrived together (engine.batch.generate.BatchSession.add_many): each one's
        `engine.pflash.Compressed` or its error; the compressing ones share drafter visits."""
        return compress_requests(self, jobs)

    def compress(self, prompt_ids: list[int], request: GenerationRequest, telemetry: Telemetry) -> list[int]:
        """PFlash prompt compression when the job asks for it (engine.pflash). Sets
        `compress_drafter_sha256` to the drafter checkpoint's hash when this job was compressed."""
        return compress_for_request(self, prompt_ids, request, telemetry)

    def warm_up(self) -> float:
        """Compile the fused kernels and capture the decode graph before the first job, so its
        telemetry measures the job (a worker calls this once at start). Returns seconds spent."""
        started = time.perf_counter()
        prompt = list(range(min(16, self.config.vocab_size)))
        for sampling in (SamplingParams(max_new_tokens=4, ignore_eos=True),       # the greedy chain's graph
                         SamplingParams(max_new_tokens=4, ignore_eos=True, temperature=1.0, seed=0)):  # plain
            self.generate_ids(prompt, GenerationRequest(sampling=sampling))
        self.cache.reset()
        return time.perf_counter() - started

    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        if prompt_tokens + max_new_tokens > self.max_context:
            raise PromptTooLongError(
                f"the prompt has {prompt_tokens} tokens and max_new_tokens is {max_new_tokens}: "
                f"{prompt_tokens + max_new_tokens} > the {self.max_context}-token context; shorten the "
                "document, lower max_new_tokens or submit with --compress auto")

    def fingerprint(self, request: GenerationRequest) -> dict:
        s, spec, comp = request.sampling, request.speculation, request.compression
        drafter = {}
        if spec.method == "draft" and spec.drafter_path in self.drafters:
            # the checkpoint file's hash; a '#layers=N' view of it is told by drafter_path
            drafter["drafter_sha256"] = self.drafters[spec.drafter_path].checkpoint_sha256.partition("#")[0]
        return {
            "target_sha256": self.checkpoint_sha256, "target_path": self.checkpoint_path,
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "kv_dtype": str(self.cache.dtype).removeprefix("torch."), "device": str(self.device),
            "host": socket.gethostname(), "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
            "seed": s.seed, "max_new_tokens": s.max_new_tokens, "spec_method": spec.method,
            "spec_width": spec.width, "drafter_path": spec.drafter_path or comp.drafter_path,
            "compress": comp.mode, "keep_ratio": comp.keep_ratio if comp.mode != "off" else None,
            "scoring_window": scoring_window_key(self.compressor) if comp.mode != "off" else None,
            "attention": self.attention if self.attention == "dense" else f"sparse-top{self.cache.sparse_top_k}",
            "decode_mlp": "fused" if self.fused_mlp else "chain",
            # the PFlash drafter's checkpoint hash, where this job's prompt was compressed
            "compress_drafter_sha256": self.compress_drafter_sha256 or None,
            **drafter,
        }

    # ---- many jobs per step ---------------------------------------------------------------

    def batch_engine(self, options=None):
        """The batch engine over this engine's model (built at first use: its KV pool takes
        `kv_memory_fraction` of the device memory free then)."""
        if self._batch is None or options is not None:
            options = options or self._default_batch_options()
            self.release_batch_engine()   # the old pool goes before the new one is sized
            self._batch = BatchEngine(self.model, self.cache, max_context=self.max_context,
                                      prefill_chunk=self.prefill_chunk, eos_ids=self.eos_ids,
                                      decode_text=self.codec.decode if self.codec else None, options=options,
                                      drafters=self.drafters)
            if self.attention == "sparse":   # accepted, but it has no effect there: say so
                self._batch.notes.append("attention=sparse has no effect in the batch engine: its decode rows "
                                         "attend densely over the paged cache (kernels.paged_attention)")
        return self._batch

    def _default_batch_options(self) -> BatchOptions:
        # CUDA: 4K-token chunks keep a 4K document's prefill in one flash call
        drafters = self.engine_config.drafters
        if self.device.type == "cuda":
            return BatchOptions(block_size=64, prefill_chunk=4096, drafters=drafters)
        return BatchOptions(block_size=16, drafters=drafters)

    def _size_batch_for_drafter(self, drafter_path: str) -> None:
        """On CUDA the batch engine's pool takes most of the free memory, so a drafter's pool
        must be sized with it: an idle batch engine built without this drafter is built again
        with it (`BatchOptions.drafters`). A busy one is left alone: the job then gets a pool
        only if the device has room for it."""
        batch = self._batch
        if self.device.type != "cuda" or (batch is not None and (batch.has_drafter(drafter_path) or batch.has_work)):
            return
        options = self._default_batch_options() if batch is None else batch.options
        if drafter_path not in options.drafters:
            self.batch_engine(replace(options, drafters=options.drafters + (drafter_path,)))

    @property
    def batch(self):
        """The batch engine if one was built (`batch_engine()` builds it), else None."""
        return self._batch

    def release_batch_engine(self) -> None:
        """Give the batch engine's KV pool back (the next `batch_engine()` builds a new one)."""
        self._batch = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def generate_many(self, requests, **kwargs):
        """Run many requests together; yield (index, GenerationResult or EngineError) as each
        finishes (engine.batch.generate_many)."""
        return generate_many(self, requests, **kwargs)

    def close(self) -> None:
        self._batch = None
        self.drafters.clear()
        del self.runner, self.cache, self.model, self.drafters  # the drafters' target holds the model
        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.empty_cache()

