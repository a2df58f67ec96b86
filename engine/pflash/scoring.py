"""PFlash scoring: how much the end of the prompt attends to each earlier token, by the drafter.

    scores = score_prompt(drafter_model, drafter_ids)   # [S] float32, one score per token

The drafter prefills the prompt in chunks (never a full S x S attention); during the last
forward, over the final `tail_rows` (8) tokens, an attention observer takes each layer's query
rows against all S cached keys. A key's score in one layer is the max over heads of the tail
rows' mean softmax probability; its final score is the max over layers (docs/design.md section 3).

Prompts longer than `window.exact_tokens` (12,288 by default) are prefilled with sliding-window
+ sink attention (engine.pflash.window: linear in S instead of quadratic; the approximation is
documented there); the tail pass over all keys stays exact. Shorter prompts are scored exactly.

The per-layer reduction is `kernels.chunk_scoring.score_tail_queries` (Triton on CUDA, which
never stores the probabilities; its reference elsewhere), or `score_tail_queries_torch` below
when the kernels package is absent: with 8 query rows the [Hq, 8, S] float32 probabilities are
small anyway (14 heads x 8 x 128K x 4 B = 59 MB).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from batchd.engine.kv_cache import ContiguousKVCache, KVCache
from batchd.engine.model import Transformer
from batchd.engine.pflash.window import DEFAULT_SCORING_WINDOW, ScoringWindow, prefill_windowed

TAIL_ROWS = 8

# (q_tail [Hq, T, D], k [Hkv, S, D], *, scale) -> key scores [S] float32
TailScorer = Callable[..., torch.Tensor]


def score_tail_queries_torch(q_tail: torch.Tensor, k: torch.Tensor, *, scale: Optional[float] = None) -> torch.Tensor:
    """q_tail: [Hq, T, D], the last T query rows of an S-token sequence; k: [Hkv, S, D].
    Returns [S] float32: max over heads of the rows' mean attention probability per key.
    Row t sees keys [0, S - T + t] (lower-right causal), as in the model's own attention."""
    Hq, T, D = q_tail.shape
    Hkv, S, _ = k.shape
    if Hq % Hkv or T > S:
        raise ValueError(f"q_tail {list(q_tail.shape)} does not fit k {list(k.shape)}")
    scale = D**-0.5 if scale is None else scale
    group = Hq // Hkv
    q = q_tail.float().reshape(Hkv, group * T, D)  # heads of one KV group share its keys
    logits = torch.matmul(q, k.float().transpose(1, 2)) * scale  # [Hkv, G*T, S]
    rows = torch.arange(T, device=k.device).repeat(group)  # [G*T]: row index t of each lane
    hidden = torch.arange(S, device=k.device)[None, :] > (S - T + rows)[:, None]
    probs = logits.masked_fill_(hidden, float("-inf")).softmax(dim=-1)
    return probs.view(Hq, T, S).mean(dim=1).amax(dim=0)


def default_tail_scorer() -> TailScorer:
    try:  # kept from when the kernels were a package of their own that could be missing
        from batchd.kernels.chunk_scoring import score_tail_queries
    except ImportError:
        return score_tail_queries_torch
    return score_tail_queries


@torch.inference_mode()
def score_prompt(model: Transformer, ids: list[int], *, tail_rows: int = TAIL_ROWS, prefill_chunk: int = 2048,
                 scorer: Optional[TailScorer] = None,
                 window: Optional[ScoringWindow] = DEFAULT_SCORING_WINDOW) -> torch.Tensor:
    """Prefill `ids` through `model` and return per-token scores [len(ids)] float32 (device of
    the model). The KV cache is this call's own, sized to the prompt, and freed on return.
    A prompt longer than window.exact_tokens is prefilled with windowed attention
    (engine.pflash.window); window=None: always exact."""
    if not ids:
        raise ValueError("cannot score an empty prompt")
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    S, T = len(ids), min(tail_rows, len(ids))
    cache = ContiguousKVCache(model.config, S, model.device, model.dtype)
    tokens = torch.tensor([ids], dtype=torch.long, device=model.device)  # [1, S]
    windowed = window is not None and window.applies(S)
    for begin in range(0, S - T, prefill_chunk):
        rows = tokens[:, begin : min(begin + prefill_chunk, S - T)]
        if windowed:
            prefill_windowed(model, rows, cache, window.attend)
        else:
            model(rows, cache, last_only=True)
    return score_tail(model, tokens[:, S - T :], cache, scorer)


@torch.inference_mode()
def score_tail(model: Transformer, tail: torch.Tensor, cache: KVCache,
               scorer: Optional[TailScorer] = None) -> torch.Tensor:
    """tail: [1, T] the prompt's last T tokens, after the rest is in `cache`. Runs their forward
    (exact: every tail row attends to all keys) and returns [S] float32 scores, S = cache rows
    after it: the max over layers of `scorer` on each layer's tail queries and whole cache."""
    scorer = scorer or default_tail_scorer()
    S = cache.length + tail.shape[1]
    scores = torch.zeros(S, dtype=torch.float32, device=model.device)
    scale = model.layers[0].self_attn.scale

    def observe(layer_idx: int, q, keys, values, start: int) -> None:
        # q: [1, Hq, T, D] post-rope tail queries; keys: [1, Hkv, S, D], this layer's whole cache
        torch.maximum(scores, scorer(q[0].to(keys.dtype), keys[0], scale=scale), out=scores)

    model(tail, cache, observer=observe, last_only=True)
    return scores
