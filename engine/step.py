"""Runs model steps at the cache's current length; on CUDA through captured CUDA graphs.

A decode (T=1) or verify (T=q) step has static shapes, so each width is captured once per
cache and replayed: the positions come from `cache.length_on_device`, so a replay needs nothing
from the host. Prefill chunks and CPU steps run eagerly.

Greedy decoding goes further (`greedy_step`): its graph also picks the next token, records it and
feeds it to its own next replay, and advances the device length, so a step is one graph launch
with nothing launched from the host between tokens.
"""
from __future__ import annotations

import torch

from batchd.engine.cuda_graphs import capture
from batchd.engine.kv_cache import KVCache
from batchd.engine.model import Transformer
from batchd.kernels.argmax import pick_and_advance
from batchd.kernels.sparse_attention import sparse_is_worthwhile

MAX_GRAPH_WIDTH = 17  # the widest verify step: 16 drafts plus the last accepted token


class StepRunner:
    def __init__(self, model: Transformer, cache: KVCache, *, cuda_graphs: bool = True):
        self.model, self.cache = model, cache
        self.cuda_graphs = cuda_graphs and cache.device.type == "cuda"
        # one graph per (width, sparse?, greedy chain?): with sparse attention the host picks, per
        # step, the graph whose attention the sparse rule asks for at this length
        self._graphs: dict[tuple[int, bool, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._pool = None
        # greedy chain: the token fed to the next replay [1, 1], and picked[i] = the greedy token
        # chosen after cache row i ([max_len] long), shared by the chain's dense and sparse graphs
        self._chain_tokens: torch.Tensor | None = None
        self._picked: torch.Tensor | None = None

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [1, T] on the model's device -> logits [1, T, V] float32; appends T rows.
        Graph outputs are static buffers: copy what must outlive the next step."""
        T = tokens.shape[1]
        if not self.cuda_graphs or T > MAX_GRAPH_WIDTH:
            return self.model(tokens, self.cache)
        cache = self.cache
        cache.reserve(T)
        cache.sparse_step = self._sparse_rule(T)
        key = (T, cache.sparse_step, False)
        graph, static_tokens, static_logits = self._graphs.get(key) or self._capture(key)
        static_tokens.copy_(tokens)
        graph.replay()
        cache.advance(T)
        self._follow_summaries()
        return static_logits

    @property
    def chains(self) -> bool:
        """Whether `greedy_step` replays one graph per token (CUDA graphs on)."""
        return self.cuda_graphs

    @torch.inference_mode()
    def greedy_step(self, token: torch.Tensor) -> torch.Tensor:
        """token: [1] (or [1, 1]) on the device, the next input -> the greedy token after it, [1]:
        a view of a buffer that later steps do not overwrite (row i's pick lives at index i), so
        the caller may hold it until it reads it back. The same ids as `step` then argmax."""
        cache = self.cache
        cache.reserve(1)
        if self._picked is None:
            self._chain_tokens = torch.zeros((1, 1), dtype=torch.long, device=cache.device)
            self._picked = torch.zeros(cache.max_len, dtype=torch.long, device=cache.device)
        row = cache.length
        if not (row > 0 and token.data_ptr() == self._picked[row - 1 :].data_ptr()):
            self._chain_tokens.copy_(token.view(1, 1))  # not the chain's own last pick: feed it
        cache.sparse_step = self._sparse_rule(1)
        key = (1, cache.sparse_step, True)
        graph = (self._graphs.get(key) or self._capture(key))[0]
        graph.replay()
        cache.advanced_on_device(1)                     # the graph advanced length_on_device
        self._follow_summaries()
        return self._picked[row : row + 1]

    def _follow_summaries(self) -> None:
        for summary in self.cache.block_summaries or ():
            summary.length = self.cache.length  # the replay updated the summaries on the device

    def _sparse_rule(self, width: int) -> bool:
        if self.cache.block_summaries is None:
            return False
        block_size = self.cache.block_summaries[0].block_size
        return sparse_is_worthwhile(self.cache.length + width, width, self.cache.sparse_top_k, block_size)

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, chunk_size: int) -> torch.Tensor:
        """tokens: [1, N] -> logits of the last position [1, 1, V]; chunked to bound activations."""
        logits = None
        for begin in range(0, tokens.shape[1], chunk_size):
            logits = self.model(tokens[:, begin : begin + chunk_size], self.cache, last_only=True)
        return logits

    def _capture(self, key: tuple[int, bool, bool]):
        width, _, chain = key
        cache, model = self.cache, self.model
        static_tokens = self._chain_tokens if chain else torch.zeros((1, width), dtype=torch.long, device=cache.device)
        saved_length = cache.length

        def run():
            logits = model.forward_at(static_tokens, cache, cache.length, start_on_device=cache.length_on_device,
                                      float_logits=not chain)
            if chain:  # pick (torch.argmax's id), record it, feed it to the next replay, advance the length
                pick_and_advance(logits[:, -1], self._picked, static_tokens, cache.length_on_device)
            return logits

        # warm-up and capture both write rows at the current length, which the real step
        # overwrites right after (a chain's warm-up also moves its token and the device length:
        # put back after each)
        fed = static_tokens.clone() if chain else None

        def put_back() -> None:
            static_tokens.copy_(fed)
            cache.length_on_device.fill_(saved_length)

        graph, static_logits = capture(run, self._pool, after_warmup=put_back if chain else None)
        self._pool = graph.pool()
        assert cache.length == saved_length
        self._graphs[key] = (graph, static_tokens, static_logits)
        return self._graphs[key]
