"""Draft models: loading, checking the vocabulary, and building smaller drafters from a target.

A drafter is a `DraftModel`: a model with a KV cache and a step runner of its own (what a
proposer needs, not an Engine). A target engine keeps its drafters in a `Drafters` (the
engine's `drafters`), by the job's `drafter_path`, so a worker loads each once. `drafter_path` is

- a checkpoint path (HF folder or GGUF), loaded on the target's device and dtype;
- the target's own checkpoint path: the target drafts for itself, sharing its weights (no copy);
- either of these with `#layers=N`: only the first N layers, then the final norm and the head,
  of that checkpoint (sharing the target's tensors when it is the target's checkpoint).

A drafter must have the target's vocabulary: same `vocab_size`, and the same tokenizer when both
have one. Anything else is refused; token ids would mean different words.

Loaded drafters are kept by file identity and layer count (however the path is spelled: '/./',
'//', links), at most `DRAFTERS_KEPT` of them, the least recently used dropped first.

A service never lets a job choose a path: its `DrafterCatalog` maps names, set by whoever
starts the engine (a worker's `--drafter-checkpoint NAME=PATH`), to checkpoints, and a job names
one (`"drafter": "qwen-0.5b"` or `"smollm2-135m#layers=6"`).
"""
from __future__ import annotations

import dataclasses
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from batchd.engine.checkpoint import load_checkpoint
from batchd.engine.config import ModelConfig
from batchd.engine.errors import BadInputError
from batchd.engine.fused import KernelChoice
from batchd.engine.kv_cache import ContiguousKVCache, KVCache
from batchd.engine.model import Transformer, build_model, choose_fused_mlp
from batchd.engine.drafter_names import file_identity, parse_drafter_path
from batchd.engine.step import StepRunner
from batchd.engine.text import TextCodec


@dataclass
class DraftTarget:
    """What drafting needs to know of the target: its model (shared by self and truncated
    drafters), tokenizer, checkpoint, context and step settings."""

    model: Transformer
    codec: Optional[TextCodec]
    checkpoint_path: str
    checkpoint_sha256: str
    max_context: int
    prefill_chunk: int
    cuda_graphs: bool

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def ops(self) -> KernelChoice:
        return self.model.ops


@dataclass
class DraftModel:
    """A drafter: its model, its own KV cache and step runner, and the checkpoint it came from
    (`checkpoint_sha256` goes into the job's fingerprint). An Engine has the same attributes, so
    one may be registered as a drafter too."""

    model: Transformer
    codec: Optional[TextCodec]
    cache: KVCache
    runner: StepRunner
    prefill_chunk: int
    checkpoint_sha256: str
    checkpoint_path: str

    @property
    def config(self) -> ModelConfig:
        return self.model.config


DRAFTERS_KEPT = 2   # loaded drafters an engine keeps (each holds a KV cache of the full context)


class Drafters:
    """The draft models of one target engine: those `register`ed by name, and up to `capacity`
    loaded on demand by `drafter_path`, keyed by file identity and layer count."""

    def __init__(self, target: DraftTarget, capacity: int = DRAFTERS_KEPT):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.target = target
        self.capacity = capacity
        self._registered: dict[str, object] = {}
        self._loaded: OrderedDict[tuple, object] = OrderedDict()   # least recently used first

    def get(self, drafter_path: str, telemetry=None):
        """The drafter for `drafter_path`, loaded on first use (its time goes to `telemetry`)."""
        if drafter_path in self._registered:
            return self._registered[drafter_path]
        key = drafter_key(drafter_path)
        drafter = self._loaded.get(key)
        if drafter is not None:
            self._loaded.move_to_end(key)
            return drafter
        started = time.perf_counter()
        drafter = _build_drafter(self.target, drafter_path)
        check_same_vocabulary(self.target, drafter, drafter_path)
        while len(self._loaded) >= self.capacity:
            self._loaded.popitem(last=False)
        self._loaded[key] = drafter
        if telemetry is not None:
            telemetry.drafter_load_s += time.perf_counter() - started
        return drafter

    def register(self, name: str, drafter) -> None:
        """Make `drafter` (a DraftModel, or an Engine) available to jobs whose `drafter_path` is `name`."""
        check_same_vocabulary(self.target, drafter, name)
        self._registered[name] = drafter

    def __contains__(self, name: str) -> bool:
        return name in self._registered or drafter_key(name) in self._loaded

    def __getitem__(self, name: str):
        return self._registered[name] if name in self._registered else self._loaded[drafter_key(name)]

    def __len__(self) -> int:
        return len(self._registered) + len(self._loaded)

    def clear(self) -> None:
        self._registered.clear()
        self._loaded.clear()


def drafter_key(drafter_path: str) -> tuple:
    """(the file's identity, or its real path when it does not exist; the layer count)."""
    path, layers = parse_drafter_path(drafter_path)
    return (file_identity(path) or os.path.realpath(path), layers)


def check_same_vocabulary(target, drafter, name: str = "the drafter") -> None:
    t_size, d_size = target.config.vocab_size, drafter.config.vocab_size
    if t_size != d_size:
        raise BadInputError(
            f"drafter {name} has a vocabulary of {d_size} tokens, the target {t_size}: a draft model must "
            "share the target's tokenizer; pick one from the target's model family or use --spec lookup")
    if target.codec is not None and drafter.codec is not None and target.codec is not drafter.codec:
        t_vocab, d_vocab = target.codec.tokenizer.get_vocab(), drafter.codec.tokenizer.get_vocab()
        if t_vocab != d_vocab:
            raise BadInputError(
                f"drafter {name}'s tokenizer ({len(d_vocab)} tokens) differs from the target's "
                f"({len(t_vocab)} tokens): a draft model must share the target's tokenizer; "
                "pick one from the target's model family or use --spec lookup")


def _build_drafter(target: DraftTarget, drafter_path: str):
    path, layers = parse_drafter_path(drafter_path)
    if target.checkpoint_path and _same_file(path, target.checkpoint_path):
        base = target
    else:
        if not os.path.exists(path):
            raise BadInputError(f"drafter checkpoint {path} does not exist; give a GGUF file or a model folder")
        base = load_draft_model(target, path)
    if layers is None:
        return base if base is not target else self_drafter(target)
    return truncated_drafter(base, layers)


def load_draft_model(target: DraftTarget, path: str) -> DraftModel:
    """Another checkpoint as a drafter, on the target's device and dtype, with the target's
    kernels and the step settings an engine loaded from `path` would have: the fused MLP where
    the engine would choose it, and CUDA graphs on (the engine's default: the target's own
    setting was never passed on)."""
    ckpt = load_checkpoint(path, dtype=target.model.dtype)
    model = build_model(ckpt.config, str(target.device), target.model.dtype, tensors=ckpt.tensors, source=str(path),
                        ops=target.ops)
    choose_fused_mlp(model)
    codec = TextCodec(ckpt.tokenizer, ckpt.chat_template, ckpt.bos_token, ckpt.eos_token,
                      template_source=ckpt.chat_template_source)
    return _draft_model(model, codec, target.max_context, target.prefill_chunk, True, ckpt.sha256, str(path))


def _same_file(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _draft_model(model: Transformer, codec, max_context: int, prefill_chunk: int, cuda_graphs: bool,
                 sha256: str, path: str) -> DraftModel:
    cache = ContiguousKVCache(model.config, max_context, model.device, model.dtype)
    model.setup_rope(max_context)
    return DraftModel(model, codec, cache, StepRunner(model, cache, cuda_graphs=cuda_graphs), prefill_chunk,
                      sha256, path)


def self_drafter(target) -> DraftModel:
    """The target drafting for itself: its own model (shared weights) with a cache of its own.
    Acceptance is 1.0 under greedy decoding: an upper bound for the speculative machinery.
    `target`: a DraftTarget (an engine's `drafters.target`)."""
    return _draft_model(target.model, target.codec, target.max_context, target.prefill_chunk, target.cuda_graphs,
                        target.checkpoint_sha256, target.checkpoint_path)


def truncated_drafter(target, num_layers: int) -> DraftModel:
    """A drafter made of the target's first `num_layers` layers, its final norm and its head,
    sharing the target's tensors (no memory beyond its own KV cache). `target`: a DraftTarget,
    or a DraftModel loaded from another checkpoint (then its settings come from the DraftTarget
    it was loaded for)."""
    total = target.config.num_layers
    if not 1 <= num_layers <= total:
        raise BadInputError(f"a truncated drafter needs 1..{total} layers of this {total}-layer model, got {num_layers}")
    config = dataclasses.replace(target.config, num_layers=num_layers)
    with torch.device("meta"):  # a skeleton: every module is replaced by the target's below
        model = Transformer(config)
    model.embed_tokens = target.model.embed_tokens
    model.layers = nn.ModuleList(list(target.model.layers)[:num_layers])
    model.norm = target.model.norm
    model.lm_head = target.model.lm_head
    model.use_ops(target.model.ops)
    return _draft_model(model.eval(), target.codec, _max_context(target), target.prefill_chunk, _cuda_graphs(target),
                        f"{target.checkpoint_sha256}#layers={num_layers}",
                        f"{target.checkpoint_path}#layers={num_layers}")


def _max_context(target) -> int:
    return target.max_context if isinstance(target, DraftTarget) else target.cache.max_len


def _cuda_graphs(target) -> bool:
    return target.cuda_graphs if isinstance(target, DraftTarget) else target.runner.cuda_graphs
