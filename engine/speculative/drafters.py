"""Draft models: loading, checking the vocabulary, and building smaller drafters from a target.

A drafter is an `engine.runtime.Engine` of its own (model, KV cache, step runner), cached on the
target engine under the job's `drafter_path`, so a worker loads it once. `drafter_path` is

- a checkpoint path (HF folder or GGUF), loaded on the target's device and dtype;
- the target's own checkpoint path: the target drafts for itself, sharing its weights (no copy);
- either of these with `#layers=N`: only the first N layers, then the final norm and the head,
  of that checkpoint (sharing the target's tensors when it is the target's checkpoint).

A drafter must have the target's vocabulary: same `vocab_size`, and the same tokenizer when both
have one. Anything else is refused; token ids would mean different words.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional

import torch
from torch import nn

from batchd.engine.errors import BadInputError
from batchd.engine.model import Transformer


def load_drafter(engine, drafter_path: str, telemetry=None):
    """The drafter for `drafter_path`, loaded once per engine (kept in `engine._drafters`)."""
    drafter = engine._drafters.get(drafter_path)
    if drafter is None:
        started = time.perf_counter()
        drafter = _build_drafter(engine, drafter_path)
        register_drafter(engine, drafter_path, drafter)
        if telemetry is not None:
            telemetry.drafter_load_s += time.perf_counter() - started
    return drafter


def register_drafter(engine, name: str, drafter) -> None:
    """Make `drafter` (an Engine) available to jobs whose `drafter_path` is `name`."""
    check_same_vocabulary(engine, drafter, name)
    engine._drafters[name] = drafter


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


def _build_drafter(engine, drafter_path: str):
    path, layers = parse_drafter_path(drafter_path)
    if engine.checkpoint_path and _same_file(path, engine.checkpoint_path):
        base = engine
    else:
        from batchd.engine.runtime import Engine

        if not os.path.exists(path):
            raise BadInputError(f"drafter checkpoint {path} does not exist; give a GGUF file or a model folder")
        base = Engine.load(path, device=str(engine.device), dtype=str(engine.model.dtype).removeprefix("torch."),
                           max_context=engine.max_context, prefill_chunk=engine.prefill_chunk)
    if layers is None:
        return base if base is not engine else self_drafter(engine)
    return truncated_drafter(base, layers)


def parse_drafter_path(drafter_path: str) -> tuple[str, Optional[int]]:
    """'model.gguf#layers=6' -> ('model.gguf', 6); 'model.gguf' -> ('model.gguf', None)."""
    path, sep, suffix = drafter_path.partition("#")
    if not sep:
        return path, None
    key, _, value = suffix.partition("=")
    if key != "layers" or not value.isdigit() or int(value) < 1:
        raise BadInputError(f"drafter {drafter_path!r}: the only suffix is '#layers=N' with N >= 1")
    return path, int(value)


def _same_file(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _drafter_engine(target, model: Transformer, sha256: str, path: str):
    from batchd.engine.runtime import Engine

    return Engine(model, target.codec, max_context=target.max_context, eos_ids=set(target.eos_ids),
                  checkpoint_sha256=sha256, checkpoint_path=path, cuda_graphs=target.runner.cuda_graphs,
                  prefill_chunk=target.prefill_chunk)


def self_drafter(target):
    """The target drafting for itself: its own model (shared weights) with a cache of its own.
    Acceptance is 1.0 under greedy decoding: an upper bound for the speculative machinery."""
    return _drafter_engine(target, target.model, target.checkpoint_sha256, target.checkpoint_path)


def truncated_drafter(target, num_layers: int):
    """A drafter made of the target's first `num_layers` layers, its final norm and its head,
    sharing the target's tensors (no memory beyond its own KV cache)."""
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
    return _drafter_engine(target, model.eval(), f"{target.checkpoint_sha256}#layers={num_layers}",
                           f"{target.checkpoint_path}#layers={num_layers}")
