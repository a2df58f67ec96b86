"""Runs the decode-rows forward: eagerly on the CPU, on CUDA through one captured graph per
bucket of rows, so a step costs the host two small copies and one replay.

Rows are padded up to the bucket (a multiple of the projection slab: a row's arithmetic is the
same in any bucket). Padding rows read and write the pool's spare block only. The attention grid
is sized for the whole context, so one graph serves every length.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from batchd.engine.batch.paged_cache import PagedKVCache
from batchd.engine.cuda_graphs import capture
from batchd.engine.batch.rows import RowBatch, forward_rows


def take_carried(tokens: torch.Tensor, ids: torch.Tensor, sources: list[int]) -> None:
    """tokens [N] long on the device, in place: row n takes ids[sources[n]] where sources[n] >= 0."""
    source = torch.tensor(sources, dtype=torch.long)
    source = (source.pin_memory() if tokens.is_cuda else source).to(tokens.device, non_blocking=True)
    tokens.copy_(torch.where(source >= 0, ids[source.clamp(min=0)], tokens))


class RowRunner:
    def __init__(self, model, cache: PagedKVCache, *, max_context: int, slab_rows: int | None, cuda_graphs: bool):
        self.model, self.cache = model, cache
        self.max_context, self.slab_rows = max_context, slab_rows
        self.max_blocks = -(-max_context // cache.block_size)
        self.cuda_graphs = cuda_graphs and model.device.type == "cuda"
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._pool = None

    def drop_graphs(self) -> None:
        """Forget every captured graph (parking moved the weights they read); capture again on use."""
        self._graphs.clear()
        self._pool = None

    def bucket(self, rows: int) -> int:
        step = self.slab_rows or 16
        return -(-rows // step) * step

    @torch.inference_mode()
    def run(self, tokens: list[int], positions: list[int], tables: list[list[int]],
            carried: Optional[tuple[torch.Tensor, list[int]]] = None) -> torch.Tensor:
        """One row per (token, position, its sequence's block table) -> logits [N, V] float32.
        `carried`: (ids [M] long on the device, a source per row): a row whose source s >= 0
        takes ids[s] as its token instead of tokens[n], on the device, so the host never waits
        for a step it launched ahead (engine.batch.batch_engine, "Launching ahead")."""
        n = len(tokens)
        width = self.max_blocks if self.cuda_graphs else max(map(len, tables))
        rows = self.bucket(n) if self.cuda_graphs else n
        ids = np.zeros((2, rows), dtype=np.int64)
        ids[0, :n], ids[1, :n] = tokens, positions
        # rows of one sequence share its table (a verify's lanes): fill each table once, copy the rest
        table_rows = np.full((rows, width), self.cache.pad_block, dtype=np.int32)
        first_row: dict[int, int] = {}
        for i, table in enumerate(tables):
            seen = first_row.setdefault(id(table), i)
            if seen == i:
                table_rows[i, : len(table)] = table
            else:
                table_rows[i] = table_rows[seen]
        host_ids, host_tables = torch.from_numpy(ids), torch.from_numpy(table_rows)
        if not self.cuda_graphs:
            device = self.model.device
            ids, block_tables = host_ids.to(device), host_tables.to(device)
            if carried is not None:
                take_carried(ids[0, :n], *carried)
            batch = RowBatch.derive(ids[0], ids[1], block_tables, self.cache.block_size, max(positions) + 1)
            return forward_rows(self.model, self.cache, batch, slab_rows=self.slab_rows)
        graph, static_ids, static_tables, logits = self._graphs.get(rows) or self._capture(rows)
        # pinned sources: a copy from pageable memory may wait for the stream (the step in flight)
        static_ids.copy_(host_ids.pin_memory(), non_blocking=True)
        static_tables.copy_(host_tables.pin_memory(), non_blocking=True)
        if carried is not None:
            take_carried(static_ids[0, :n], *carried)
        graph.replay()
        return logits[:n]

    def _capture(self, rows: int):
        device = self.model.device
        static_ids = torch.zeros((2, rows), dtype=torch.long, device=device)        # padding: token 0 at 0
        static_tables = torch.full((rows, self.max_blocks), self.cache.pad_block, dtype=torch.int32, device=device)

        def run():
            batch = RowBatch.derive(static_ids[0], static_ids[1], static_tables, self.cache.block_size,
                                    self.max_context)
            return forward_rows(self.model, self.cache, batch, slab_rows=self.slab_rows)

        graph, logits = capture(run, self._pool)
        self._pool = graph.pool()
        self._graphs[rows] = (graph, static_ids, static_tables, logits)
        return self._graphs[rows]
