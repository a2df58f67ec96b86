"""A prompt's first chunk: the one-sequence prefill (fused kernels, cuDNN flash attention) on a
contiguous scratch cache, its rows then copied into the sequence's blocks of the paged pool.

On CUDA a short chunk (up to `graph_tokens`) is padded on the right to a multiple of `granule`
tokens and replayed from a graph captured once per padded length, with the copy into the pool
inside the graph. An eager forward of a 32-layer model costs the host about 10 ms of launches,
which a short prompt's GPU work does not hide (H200, Llama-3-8B shape, `bench/prefill_rate.py`:
512 and 800 tokens both took 31 ms for 21 ms of GPU work), and PFlash's compressed prompts are
all short. Padding rows come after the chunk's last real row, so causal attention keeps them
out of every real row; their keys go to the pool's spare block. A chunk's bits follow from its
own length (which fixes the padded length), never from the step it runs in. Longer chunks, and
the CPU, run eagerly.

    runner = FirstChunkRunner(model, scratch, pool)
    logits = runner.run(prompt_ids[:end], block_table)      # [V] float32, the last row's
"""
from __future__ import annotations

import numpy as np
import torch

from batchd.engine.batch.paged_cache import PagedKVCache
from batchd.engine.cuda_graphs import capture
from batchd.engine.linear import project

GRAPH_TOKENS = 2048   # longer chunks keep the GPU busy for longer than their launches take
GRANULE = 64          # padded lengths are multiples of this (at most 63 rows of waste)


class FirstChunkRunner:
    def __init__(self, model, scratch, cache: PagedKVCache, *, cuda_graphs: bool = True,
                 graph_tokens: int = GRAPH_TOKENS, granule: int = GRANULE, padded: bool | None = None):
        """padded: pad short chunks (default: where CUDA graphs replay them). On the CPU,
        padded=True runs the graph's body eagerly (tests of the padded path)."""
        self.model, self.scratch, self.cache = model, scratch, cache
        self.graph_tokens, self.granule = graph_tokens, granule
        self.cuda_graphs = cuda_graphs and model.device.type == "cuda"
        self.padded = self.cuda_graphs if padded is None else padded
        # padded length -> (graph, tokens [1, L], last row [1], blocks [L], offsets [L], logits [1, V])
        self._graphs: dict[int, tuple] = {}
        self._pool = None

    def drop_graphs(self) -> None:
        """Forget every captured graph (parking moved the weights they read)."""
        self._graphs.clear()
        self._pool = None

    def padded_length(self, tokens: int) -> int | None:
        """The graph length a chunk of `tokens` runs at, or None: eager."""
        padded = -(-tokens // self.granule) * self.granule
        if not self.padded or tokens > self.graph_tokens or padded > self.scratch.max_len:
            return None
        return padded

    @torch.inference_mode()
    def run(self, prompt_ids: list[int], table: list[int]) -> torch.Tensor:
        """prompt_ids: positions [0, T) of one sequence; table: its block table (covering T).
        -> the last row's logits [V] float32; the T rows' keys and values are in the pool."""
        T = len(prompt_ids)
        padded = self.padded_length(T)
        if padded is None:
            tokens = torch.tensor([prompt_ids], dtype=torch.long, device=self.model.device)
            logits = self.model.forward_at(tokens, self.scratch, 0, last_only=True)   # [1, 1, V]
            self.cache.store_from_scratch(self.scratch, table, 0, T)
            return logits[0, -1]
        graph, tokens, last, blocks, offsets, logits = self._graphs.get(padded) or self._static(padded)
        host = np.zeros((3, padded), dtype=np.int64)
        host[0, :T] = prompt_ids
        positions = np.arange(T)
        host[1] = self.cache.pad_block                  # padding rows: the spare block
        host[1, :T] = np.asarray(table, dtype=np.int64)[positions // self.cache.block_size]
        host[2, :T] = positions % self.cache.block_size
        staged = torch.from_numpy(host)
        tokens.copy_(staged[0:1], non_blocking=True)
        blocks.copy_(staged[1], non_blocking=True)
        offsets.copy_(staged[2], non_blocking=True)
        last.fill_(T - 1)
        if graph is None:   # the CPU: the graph's body itself, into the same kind of output buffer
            logits.copy_(self._forward(tokens, last, blocks, offsets))
        else:
            graph.replay()
        # a copy: the next chunk of this length replays into the same buffer before the step
        # samples this one's token
        return logits[0].clone()

    def _forward(self, tokens, last, blocks, offsets) -> torch.Tensor:
        """The graph's body: tokens [1, L] -> logits [1, V] float32 of row `last` ([1] long)."""
        model, scratch = self.model, self.scratch
        normed = model.forward_at(tokens, scratch, 0, head=False)               # [1, L, H]
        row = normed[0].index_select(0, last)[None]                             # [1, 1, H]
        logits = project(row, model.lm_head, model.ops.small_linear).float()   # [1, 1, V]
        self.cache.store_scratch_rows(scratch, 0, tokens.shape[1], blocks, offsets)
        return logits[0]

    def _static(self, L: int):
        """The static inputs of length L, and on CUDA the graph over them."""
        device = self.model.device
        tokens = torch.zeros((1, L), dtype=torch.long, device=device)
        last = torch.full((1,), L - 1, dtype=torch.long, device=device)
        blocks = torch.full((L,), self.cache.pad_block, dtype=torch.long, device=device)
        offsets = torch.arange(L, device=device) % self.cache.block_size
        if not self.cuda_graphs:
            logits = torch.empty((1, self.model.config.vocab_size), dtype=torch.float32, device=device)
            self._graphs[L] = (None, tokens, last, blocks, offsets, logits)
            return self._graphs[L]
        graph, logits = capture(lambda: self._forward(tokens, last, blocks, offsets), self._pool)
        self._pool = graph.pool()
        self._graphs[L] = (graph, tokens, last, blocks, offsets, logits)
        return self._graphs[L]
