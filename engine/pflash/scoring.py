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

from batchd.engine.cuda_graphs import capture
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


SCORING_BUCKET = 512   # drafter tokens: prompts are padded on the right to a multiple of this


class PaddedScorer:
    """Scores prompts of one drafter in ONE forward each, padded on the right to a multiple of
    `bucket` tokens: on CUDA through a graph captured once per padded length, so a job costs the
    host a copy and a replay instead of two eager 24-layer forwards (measured on the H200 with a
    0.5B drafter at 4K tokens: 85 ms of host time against 12 ms of GPU work a job).

    Right padding changes nothing a score depends on: every row attends only to rows before it,
    and the padding rows come after the last real one. The tail queries (the prompt's last
    `tail_rows` rows, at device-side positions) are scored against the keys they see in every
    layer, as `score_tail_queries_torch` does. A prompt's bits depend on its own length only (the
    padded length follows from it), never on what was scored before it.

        scorer = PaddedScorer(drafter_model)
        scores = scorer.score(ids)          # [len(ids)] float32 on the model's device
    """

    def __init__(self, model: Transformer, *, tail_rows: int = TAIL_ROWS, bucket: int = SCORING_BUCKET,
                 cuda_graphs: bool = True):
        self.model, self.tail_rows, self.bucket = model, tail_rows, bucket
        self.cuda_graphs = cuda_graphs and model.device.type == "cuda"
        self._graphs: dict[int, tuple] = {}   # padded length -> (graph, tokens, positions, scores)
        self._pool = None

    def padded_length(self, n: int) -> int:
        return -(-n // self.bucket) * self.bucket

    @torch.inference_mode()
    def score(self, ids: list[int]) -> torch.Tensor:
        if not ids:
            raise ValueError("cannot score an empty prompt")
        S, L = len(ids), self.padded_length(len(ids))
        if S <= self.tail_rows:
            raise ValueError(f"a prompt of {S} tokens is all tail: score it with score_prompt")
        host = torch.zeros((1, L), dtype=torch.long)
        host[0, :S] = torch.tensor(ids, dtype=torch.long)
        positions = torch.arange(S - self.tail_rows, S)   # [tail_rows], the rows whose attention scores
        if not self.cuda_graphs:
            tokens = host.to(self.model.device)
            return self._forward(tokens, positions.to(self.model.device))[:S].clone()
        graph, tokens, static_positions, scores = self._graphs.get(L) or self._capture(L)
        tokens.copy_(host, non_blocking=True)
        static_positions.copy_(positions, non_blocking=True)
        graph.replay()
        return scores[:S].clone()

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens [1, L], positions [tail_rows] (device) -> [L] float32 scores."""
        model, L = self.model, tokens.shape[1]
        cache = ContiguousKVCache(model.config, L, model.device, model.dtype)
        scores = torch.zeros(L, dtype=torch.float32, device=model.device)
        scale = model.layers[0].self_attn.scale
        cols = torch.arange(L, device=model.device)

        def observe(layer_idx: int, q, keys, values, start: int) -> None:
            # q: [1, Hq, L, D] every row's query; keys: [1, Hkv, L, D]
            Hq, D, Hkv = q.shape[1], q.shape[3], keys.shape[1]
            group, rows = Hq // Hkv, positions.shape[0]
            q_tail = q[0].index_select(1, positions).float().reshape(Hkv, group * rows, D)
            logits = torch.matmul(q_tail, keys[0].float().transpose(1, 2)) * scale     # [Hkv, G*T, L]
            hidden = cols[None, :] > positions.repeat(group)[:, None]                 # causal, padding out
            probs = logits.masked_fill_(hidden, float("-inf")).softmax(dim=-1)
            torch.maximum(scores, probs.view(Hq, rows, L).mean(dim=1).amax(dim=0), out=scores)

        model.forward_at(tokens, cache, 0, observer=observe, last_only=True, head=False)
        return scores

    def _capture(self, L: int):
        device = self.model.device
        tokens = torch.zeros((1, L), dtype=torch.long, device=device)
        positions = torch.arange(L - self.tail_rows, L, device=device)
        graph, scores = capture(lambda: self._forward(tokens, positions), self._pool)
        self._pool = graph.pool()
        self._graphs[L] = (graph, tokens, positions, scores)
        return self._graphs[L]
