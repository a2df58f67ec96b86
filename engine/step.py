"""Runs model steps at the cache's current length; on CUDA through captured CUDA graphs.

A decode (T=1) or verify (T=q) step has static shapes, so each width is captured once per
cache and replayed: the positions come from `cache.length_on_device`, so a replay needs nothing
from the host. Prefill chunks and CPU steps run eagerly.
"""
from __future__ import annotations

import torch

from engine.kv_cache import KVCache
from engine.model import Transformer

MAX_GRAPH_WIDTH = 16


class StepRunner:
    def __init__(self, model: Transformer, cache: KVCache, *, cuda_graphs: bool = True):
        self.model, self.cache = model, cache
        # sparse attention picks blocks from host-known lengths, so its steps run eagerly
        self.cuda_graphs = cuda_graphs and cache.device.type == "cuda" and cache.block_summaries is None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._pool = None

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [1, T] on the model's device -> logits [1, T, V] float32; appends T rows.
        Graph outputs are static buffers: copy what must outlive the next step."""
        T = tokens.shape[1]
        if not self.cuda_graphs or T > MAX_GRAPH_WIDTH:
            return self.model(tokens, self.cache)
        self.cache.reserve(T)
        graph, static_tokens, static_logits = self._graphs.get(T) or self._capture(T)
        static_tokens.copy_(tokens)
        graph.replay()
        self.cache.advance(T)
        return static_logits

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, chunk_size: int) -> torch.Tensor:
        """tokens: [1, N] -> logits of the last position [1, 1, V]; chunked to bound activations."""
        logits = None
        for begin in range(0, tokens.shape[1], chunk_size):
            logits = self.model(tokens[:, begin : begin + chunk_size], self.cache, last_only=True)
        return logits

    def _capture(self, width: int):
        cache, model = self.cache, self.model
        static_tokens = torch.zeros((1, width), dtype=torch.long, device=cache.device)
        saved_length = cache.length

        def run():
            return model.forward_at(static_tokens, cache, cache.length, start_on_device=cache.length_on_device)

        # warm-up on a side stream (allocator and Triton autotuning), then capture; both write
        # rows at the current length, which the real step overwrites right after
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            static_logits = run()
        self._pool = graph.pool()
        assert cache.length == saved_length
        self._graphs[width] = (graph, static_tokens, static_logits)
        return self._graphs[width]
