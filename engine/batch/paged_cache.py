"""The paged KV cache: one pool of fixed-size blocks per layer, shared by every sequence.

    keys[layer], values[layer]: [num_blocks + 1, Hkv, block_size, D]   (the last: `pad_block`)

A sequence owns a block table (engine.batch.sequence): position p lives in block
table[p // block_size] at row p % block_size. Continuing prompt chunks (kernels.paged_prefill) and
decode and verify rows (kernels.paged_attention) write and read the pool directly; a prompt's first
chunk is computed on a contiguous scratch cache and copied in (`store_from_scratch`).
"""
from __future__ import annotations

import torch

from batchd.engine.batch.block_pool import BlockPool
from batchd.engine.config import ModelConfig


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return config.num_layers * 2 * config.num_kv_heads * block_size * config.head_dim * element


class PagedKVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, device, dtype: torch.dtype):
        # one block past the pool's own: padding rows of a CUDA-graph step write and read it
        shape = (num_blocks + 1, config.num_kv_heads, block_size, config.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.blocks = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.pad_block = num_blocks

    @classmethod
    def sized(cls, config: ModelConfig, device, dtype: torch.dtype, *, block_size: int,
              memory_fraction: float, reserve_bytes: int, max_blocks: int | None = None,
              extra_bytes_per_block: int = 0) -> "PagedKVCache":
        """A pool of `memory_fraction` of the device memory free now, less `reserve_bytes` for the
        step's activations (CUDA), or `max_blocks` blocks (CPU, where memory is not asked).
        `extra_bytes_per_block`: what other pools with the same block count (drafters') take a
        block, left free beside this one."""
        per_block = bytes_per_block(config, block_size, dtype)
        if torch.device(device).type == "cuda":
            free, _ = torch.cuda.mem_get_info(torch.device(device))
            num_blocks = int((free * memory_fraction - reserve_bytes) // (per_block + extra_bytes_per_block))
            if max_blocks is not None:
                num_blocks = min(num_blocks, max_blocks)
        else:
            num_blocks = max_blocks or 0
        if num_blocks < 1:
            raise torch.OutOfMemoryError(
                f"no room for a KV pool: {per_block} bytes a block of {block_size} positions; lower "
                "max_context or free device memory (kv_memory_fraction)")
        return cls(config, num_blocks, block_size, device, dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> None:
        """k, v: [N, Hkv, D] rows for positions at (blocks[n], offsets[n]) ([N] long each)."""
        self.keys[layer][blocks, :, offsets] = k.to(self.dtype)
        self.values[layer][blocks, :, offsets] = v.to(self.dtype)

    def store_from_scratch(self, scratch, table: list[int], start: int, end: int) -> None:
        """Copy positions [start, end) of a contiguous (batch 1) scratch cache into the sequence's
        blocks (a prompt's first chunk, computed by the one-sequence prefill)."""
        positions = torch.arange(start, end, device=self.keys[0].device)
        blocks = torch.tensor(table, dtype=torch.long, device=positions.device)[positions // self.block_size]
        self.store_scratch_rows(scratch, start, end, blocks, positions % self.block_size)

    def store_scratch_rows(self, scratch, start: int, end: int, blocks: torch.Tensor, offsets: torch.Tensor) -> None:
        """Positions [start, end) of the scratch cache at (blocks[n], offsets[n]) ([end - start]
        long each, on the device: what a CUDA graph captures)."""
        for layer in range(len(self.keys)):
            k = scratch.keys[layer][0, :, start:end].transpose(0, 1)          # [T, Hkv, D]
            v = scratch.values[layer][0, :, start:end].transpose(0, 1)
            self.write(layer, k, v, blocks, offsets)
