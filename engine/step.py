"""Runs model steps at the cache's current length; on CUDA through captured CUDA graphs.

A decode (T=1) or verify (T=q) step has static shapes, so each width is captured once per
cache and replayed: the positions come from `cache.length_on_device`, so a replay needs nothing
from the host. Prefill chunks and CPU steps run eagerly.
"""
from __future__ import annotations

import torch

from engine.kv_cache import KVCache
from engine.model import Transformer

MAX_GRAPH_WIDTH = 17  # the widest verify step: 16 drafts plus the last accepted token


class StepRunner:
    def __init__(self, model: Transformer, cache: KVCache, *, cuda_graphs: bool = True):
        self.model, self.cache = model, cache
        self.cuda_graphs = cuda_graphs and cache.device.type == "cuda"
        # one graph per (width, sparse?): with sparse attention the host picks, per step, the graph
        # whose attention the sparse rule asks for at this length
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._pool = None

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
        key = (T, cache.sparse_step)
        graph, static_tokens, static_logits = self._graphs.get(key) or self._capture(key)
        static_tokens.copy_(tokens)
        graph.replay()
        cache.advance(T)
        for summary in cache.block_summaries or ():
            summary.length = cache.length  # the replay updated the summaries on the device
        return static_logits

    def _sparse_rule(self, width: int) -> bool:
        if self.cache.block_summaries is None:
            return False
        from kernels.sparse_attention import sparse_is_worthwhile

        block_size = self.cache.block_summaries[0].block_size
        return sparse_is_worthwhile(self.cache.length + width, width, self.cache.sparse_top_k, block_size)

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, chunk_size: int) -> torch.Tensor:
        """tokens: [1, N] -> logits of the last position [1, 1, V]; chunked to bound activations."""
        logits = None
        for begin in range(0, tokens.shape[1], chunk_size):
            logits = self.model(tokens[:, begin : begin + chunk_size], self.cache, last_only=True)
        return logits

    def _capture(self, key: tuple[int, bool]):
        width = key[0]
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
        self._graphs[key] = (graph, static_tokens, static_logits)
        return self._graphs[key]
