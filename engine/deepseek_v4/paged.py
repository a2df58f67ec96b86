"""V4's cache in a pool of fixed-size blocks shared by many sequences (docs/deepseek_v4.md).

One block table per sequence serves every part: block b of a sequence holds, in each layer,
its positions' window rows and compressor projections, and the compressed entries whose windows
start in it (entry w of a rate-m compressor: the block of position w·m, slot (w·m mod block_size)/m).
So the engine.batch BlockPool and Scheduler manage V4 sequences unchanged: a block is allocated,
shared, freed and preempted as one unit, and a rollback is still moving a sequence's length.

    pool = PagedV4Pool(config, num_blocks=64, block_size=16, device="cpu", dtype=torch.float32)
    view = pool.view(seq.blocks, length=seq.computed)     # what model.forward takes, for one sequence
"""
from __future__ import annotations

import torch

from batchd.engine.batch.block_pool import BlockPool
from batchd.engine.deepseek_v4.cache import CompressorState, LayerCache
from batchd.engine.deepseek_v4.config import CSA, SLIDING, V4Config
from batchd.engine.errors import PromptTooLongError


class PagedStore:
    """One part of one sequence, read and written by index through its block table.
    pool [num_blocks + 1, slots, C]; index i covers position i·unit (unit 1: rows and
    projections; m: a compressor's entries)."""

    def __init__(self, pool: torch.Tensor, table: torch.Tensor, block_size: int, unit: int):
        self.pool, self.table, self.block_size, self.unit = pool, table, block_size, unit

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.dtype

    def _where(self, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(first, end, device=self.pool.device) * self.unit
        return self.table[positions // self.block_size], (positions % self.block_size) // self.unit

    def read(self, first: int, end: int) -> torch.Tensor:
        """-> [1, end - first, C]."""
        blocks, slots = self._where(first, end)
        return self.pool[blocks, slots][None]

    def write(self, first: int, values: torch.Tensor) -> None:
        """values [1, n, C] -> indices [first, first + n)."""
        blocks, slots = self._where(first, first + values.shape[1])
        self.pool[blocks, slots] = values[0].to(self.pool.dtype)


def _slots(block_size: int, unit: int) -> int:
    """Index slots a block holds for a part whose index i covers position i·unit."""
    if block_size % unit and unit % block_size:
        raise ValueError(f"block size {block_size} and compression rate {unit} must divide one another")
    return max(1, block_size // unit)


def part_shapes(config: V4Config, block_size: int) -> list[dict[str, tuple[int, int]]]:
    """Per layer, each part's (slots, width) in one block: rows and projections one slot a
    position, entries one slot a window that starts in the block."""
    layers = []
    for i, kind in enumerate(config.layer_types):
        parts = {"rows": (block_size, config.head_dim)}
        if kind != SLIDING:
            m = config.compress_rate(i)
            width = 2 * config.head_dim if kind == CSA else config.head_dim
            parts |= {"kv": (block_size, width), "gate": (block_size, width), "entries": (_slots(block_size, m), config.head_dim)}
            if kind == CSA:
                iwidth = 2 * config.index_head_dim
                parts |= {"index_kv": (block_size, iwidth), "index_gate": (block_size, iwidth),
                          "index_entries": (_slots(block_size, m), config.index_head_dim)}
        layers.append(parts)
    return layers


def bytes_per_block(config: V4Config, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return sum(slots * width for parts in part_shapes(config, block_size) for slots, width in parts.values()) * element


class PagedV4Pool:
    """Every layer's parts for `num_blocks` blocks (plus a spare), and the BlockPool that hands them out."""

    def __init__(self, config: V4Config, num_blocks: int, block_size: int, device, dtype: torch.dtype):
        self.config, self.block_size = config, block_size
        self.blocks = BlockPool(num_blocks, block_size)
        self.layers: list[dict[str, torch.Tensor]] = [
            {name: torch.zeros(num_blocks + 1, slots, width, device=device, dtype=dtype)
             for name, (slots, width) in parts.items()}
            for parts in part_shapes(config, block_size)]

    @classmethod
    def sized(cls, config: V4Config, block_size: int, device, dtype: torch.dtype, *, max_blocks: int,
              memory_fraction: float = 0.9, reserve_bytes: int = 1 << 30) -> "PagedV4Pool":
        """On CUDA: as many blocks as `memory_fraction` of the free memory holds after `reserve_bytes`
        for a step's activations, at most `max_blocks`; elsewhere `max_blocks`."""
        num_blocks = max_blocks
        if torch.device(device).type == "cuda":
            free, _ = torch.cuda.mem_get_info(torch.device(device))
            per_block = bytes_per_block(config, block_size, dtype)
            num_blocks = min(max_blocks, int((free * memory_fraction - reserve_bytes) // per_block))
        if num_blocks < 1:
            raise torch.OutOfMemoryError(f"no room for a V4 pool: {bytes_per_block(config, block_size, dtype)} bytes a "
                                         f"block of {block_size} positions; lower max_context or free device memory")
        return cls(config, num_blocks, block_size, device, dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for parts in self.layers for t in parts.values())

    def view(self, table: list[int], length: int) -> "PagedSequenceCache":
        """One sequence's cache over its blocks, `length` positions valid."""
        return PagedSequenceCache(self, table, length)


class PagedSequenceCache:
    """What DeepseekV4.forward takes (as V4Cache), for one sequence in the pool: its layers'
    parts through its block table. Positions past the table's blocks do not fit."""

    def __init__(self, pool: PagedV4Pool, table: list[int], length: int):
        device = pool.layers[0]["rows"].device
        blocks = torch.tensor(table, dtype=torch.long, device=device)
        bs, config = pool.block_size, pool.config
        self.max_len, self.length = len(table) * bs, length
        self.layers = []
        for i, parts in enumerate(pool.layers):
            def store(name: str, unit: int = 1) -> PagedStore:
                return PagedStore(parts[name], blocks, bs, unit)
            layer = LayerCache(store("rows"))
            if "kv" in parts:
                m = config.compress_rate(i)
                layer.compressor = CompressorState(m, store("kv"), store("gate"), store("entries", m))
                if "index_kv" in parts:
                    layer.indexer = CompressorState(m, store("index_kv"), store("index_gate"), store("index_entries", m))
            self.layers.append(layer)

    def reserve(self, new_rows: int) -> None:
        if self.length + new_rows > self.max_len:
            raise PromptTooLongError(f"{self.length + new_rows} positions do not fit the sequence's blocks "
                                     f"({self.max_len} positions); the scheduler allocates them first")

    def advance(self, rows: int) -> None:
        self.length += rows

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.length = length
