"""`Engine`: the resident model a worker keeps loaded, and the one call the service makes.

    engine = Engine.load("SmolLM2-135M-Instruct.Q4_1.gguf", device="cpu")
    result = engine.generate(GenerationRequest(prompt="...", chat=True))

The engine owns the target model, its KV cache (allocated once for `max_context` rows and
reset per job), the text codec and the step runner (CUDA graphs on CUDA). Each job runs:
(1) validate and encode, (2) compress the prompt (PFlash, optional), (3) prefill and decode,
plainly or speculatively, (4) detokenise, cut stop strings, hash, collect telemetry.
"""
from __future__ import annotations

import hashlib
import socket
import struct
import time
from typing import Optional

import torch

from batchd.engine import fused
from batchd.engine.capabilities import check_features
from batchd.engine.config import ModelConfig
from batchd.engine.errors import BadInputError, DeviceOutOfMemoryError, PromptTooLongError
from batchd.engine.generate import TokenOutput, generate_plain, synchronize
from batchd.engine.kv_cache import KVCache
from batchd.engine.linear import decode_kernels_enabled, enable_invariant_kernel
from batchd.engine.model import Transformer
from batchd.engine.pflash import compress_for_request, ensure_target_resident
from batchd.engine.sampling import Sampler
from batchd.engine.step import StepRunner
from batchd.engine.stopping import StopChecker, cut_at_stop_string
from batchd.engine.text import TextCodec
from batchd.engine.types import GenerationRequest, GenerationResult, SamplingParams, Telemetry
from batchd.kernels.fused_mlp import fused_mlp_wanted

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "f16": torch.float16}
DEFAULT_MAX_CONTEXT = 8192


def parse_dtype(name: Optional[str], device: str) -> torch.dtype:
    if name is None:
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise BadInputError(f"unknown dtype {name!r}; use one of {', '.join(sorted(DTYPES))}") from None


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def token_ids_sha256(ids: list[int]) -> str:
    return sha256_hex(struct.pack(f"<{len(ids)}i", *ids))


class Engine:
    def __init__(self, model: Transformer, codec: Optional[TextCodec], *, max_context: int,
                 eos_ids: set[int], checkpoint_sha256: str = "", checkpoint_path: str = "",
                 cuda_graphs: bool = True, prefill_chunk: int = 2048, attention: str = "dense",
                 sparse_top_k_blocks: int = 64):
        self.model = model
        self.config: ModelConfig = model.config
        self.codec = codec
        self.eos_ids = eos_ids
        self.checkpoint_sha256 = checkpoint_sha256
        self.checkpoint_path = checkpoint_path
        self.compress_drafter_sha256 = ""  # set per job by `compress`: the fingerprint names the drafter
        self.max_context = max_context
        self.prefill_chunk = prefill_chunk
        self.attention = attention
        self.device = model.device
        if self.device.type == "cuda":
            fused.enable_fusion()  # one Triton kernel per norm / rope / silu-mul (engine.fused)
            enable_invariant_kernel()  # decode and verify rows computed alike (engine.linear)
        # decode and verify MLPs in two launches instead of three (kernels.fused_mlp) on the shapes
        # where that measured faster (BATCHD_FUSED_MLP=1 forces it, 0 turns it off); down's weight
        # is stored transposed for it. Its sums of down run in another order than the chain's, so
        # the path is recorded in the fingerprint
        config = model.config
        self.fused_mlp = model.use_fused_mlp(
            self.device.type == "cuda" and decode_kernels_enabled()
            and fused_mlp_wanted(config.hidden_size, config.intermediate_size, model.dtype))
        self.notes = check_features(self.config.architecture, self.device.type, attention=attention,
                                    cuda_graphs=cuda_graphs, head_dim=self.config.head_dim)
        self.cache = KVCache(self.config, max_context, self.device, model.dtype)
        if attention == "sparse":
            self.cache.enable_sparse_attention(sparse_top_k_blocks)
        model.setup_rope(max_context)
        self.runner = StepRunner(model, self.cache, cuda_graphs=cuda_graphs)
        self._drafters: dict[str, object] = {}  # drafter path -> loaded drafter (speculation)

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str, *, device: str = "cpu", dtype: Optional[str] = None,
             max_context: Optional[int] = None, **options) -> "Engine":
        from batchd.engine.checkpoint import load_checkpoint

        torch_dtype = parse_dtype(dtype, device)
        ckpt = load_checkpoint(path, dtype=torch_dtype)
        model = build_model(ckpt.config, device, torch_dtype, tensors=ckpt.tensors, source=str(path))
        codec = TextCodec(ckpt.tokenizer, ckpt.chat_template, ckpt.bos_token, ckpt.eos_token)
        eos_ids = set(ckpt.config.eos_token_ids)
        eos_id = codec.token_id(ckpt.eos_token)
        if eos_id is not None:
            eos_ids.add(eos_id)
        context = max_context or min(ckpt.config.max_position_embeddings, DEFAULT_MAX_CONTEXT)
        return cls(model, codec, max_context=context, eos_ids=eos_ids, checkpoint_sha256=ckpt.sha256,
                   checkpoint_path=str(path), **options)

    @classmethod
    def from_config(cls, config: ModelConfig, *, device: str = "cpu", dtype: Optional[str] = None,
                    max_context: int = DEFAULT_MAX_CONTEXT, seed: int = 0, codec: Optional[TextCodec] = None,
                    **options) -> "Engine":
        """Random weights at a real model's shape: for benchmarks, where speed does not depend
        on weight values. Token-id API only unless a codec is given."""
        torch_dtype = parse_dtype(dtype, device)
        model = build_model(config, device, torch_dtype, seed=seed)
        return cls(model, codec, max_context=max_context, eos_ids=set(config.eos_token_ids),
                   checkpoint_sha256=f"random-seed-{seed}", **options)

    # ---- the job ---------------------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> GenerationResult:
        started = time.perf_counter()
        if self.codec is None:
            raise BadInputError("this engine was built without a tokenizer; use generate_ids")
        telemetry = Telemetry(device=str(self.device), notes=list(self.notes))
        ensure_target_resident(self)  # an earlier job's failed unpark is retried before this one
        prompt_ids = self.codec.encode_request(request.prompt, request.messages, request.chat)
        prompt_tokens = len(prompt_ids)
        effective_ids = self.compress(prompt_ids, request, telemetry)
        out = self.generate_ids(effective_ids, request, telemetry)
        text = cut_at_stop_string(self.codec.decode(out.token_ids), request.sampling.stop)
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
        from batchd.engine.speculative import generate_speculative

        telemetry.spec_method = spec.method
        return generate_speculative(self, prompt_ids, sampler, stopper, spec, telemetry)

    def compress(self, prompt_ids: list[int], request: GenerationRequest, telemetry: Telemetry) -> list[int]:
        """PFlash prompt compression when the job asks for it (engine.pflash). Sets
        `compress_drafter_sha256` to the drafter checkpoint's hash when this job was compressed."""
        self.compress_drafter_sha256 = ""
        if request.compression.mode == "off":
            return prompt_ids
        from batchd.engine.pflash import compressor_for

        before = compressor_for(self).last_report
        ids = compress_for_request(self, prompt_ids, request, telemetry)
        report = compressor_for(self).last_report
        if report is not None and report is not before:
            self.compress_drafter_sha256 = report.drafter_sha256.partition("#")[0]
        return ids

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
        if spec.method == "draft" and spec.drafter_path in self._drafters:
            # the checkpoint file's hash; a '#layers=N' view of it is told by drafter_path
            drafter["drafter_sha256"] = self._drafters[spec.drafter_path].checkpoint_sha256.partition("#")[0]
        return {
            "target_sha256": self.checkpoint_sha256, "target_path": self.checkpoint_path,
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "kv_dtype": str(self.cache.dtype).removeprefix("torch."), "device": str(self.device),
            "host": socket.gethostname(), "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
            "seed": s.seed, "max_new_tokens": s.max_new_tokens, "spec_method": spec.method,
            "spec_width": spec.width, "drafter_path": spec.drafter_path or comp.drafter_path,
            "compress": comp.mode, "keep_ratio": comp.keep_ratio if comp.mode != "off" else None,
            "scoring_window": self._scoring_window_key() if comp.mode != "off" else None,
            "attention": self.attention if self.attention == "dense" else f"sparse-top{self.cache.sparse_top_k}",
            "decode_mlp": "fused" if self.fused_mlp else "chain",
            # the PFlash drafter's checkpoint hash, where this job's prompt was compressed
            "compress_drafter_sha256": self.compress_drafter_sha256 or None,
            **drafter,
        }

    def _scoring_window_key(self) -> str:
        """How long prompts are scored: the window decides which chunks survive compression."""
        from batchd.engine.pflash import compressor_for

        window = compressor_for(self).scoring_window
        return "exact" if window is None else f"w{window.window}-b{window.block}-s{window.sink}"

    # ---- many jobs per step ---------------------------------------------------------------

    def batch_engine(self, options=None):
        """The batch engine over this engine's model (built at first use: its KV pool takes
        `kv_memory_fraction` of the device memory free then)."""
        if getattr(self, "_batch", None) is None or options is not None:
            from batchd.engine.batch import BatchEngine, BatchOptions

            if options is None:   # CUDA: 4K-token chunks keep a 4K document's prefill in one flash call
                options = (BatchOptions(block_size=64, prefill_chunk=4096) if self.device.type == "cuda"
                           else BatchOptions(block_size=16))
            self.release_batch_engine()   # the old pool goes before the new one is sized
            self._batch = BatchEngine(self.model, self.cache, max_context=self.max_context,
                                      prefill_chunk=self.prefill_chunk, eos_ids=self.eos_ids,
                                      decode_text=self.codec.decode if self.codec else None, options=options)
        return self._batch

    def release_batch_engine(self) -> None:
        """Give the batch engine's KV pool back (the next `batch_engine()` builds a new one)."""
        self._batch = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def generate_many(self, requests, **kwargs):
        """Run many requests together; yield (index, GenerationResult or EngineError) as each
        finishes (engine.batch.generate_many)."""
        from batchd.engine.batch import generate_many

        return generate_many(self, requests, **kwargs)

    def close(self) -> None:
        self._batch = None
        self._drafters.clear()
        del self.runner, self.cache, self.model
        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.empty_cache()


def build_model(config: ModelConfig, device: str, dtype: torch.dtype, *, tensors=None, source="checkpoint",
                seed: int = 0) -> Transformer:
    """Build on the target device in `dtype`; load tensors, or fill random weights."""
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if tensors is not None:
        model.load_hf_tensors(tensors, source)
    else:
        init_random(model, seed)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def init_random(model: Transformer, seed: int) -> None:
    generator = torch.Generator(device=model.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=generator)
