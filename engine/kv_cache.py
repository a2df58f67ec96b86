"""Preallocated key/value cache of one sequence batch.

Buffers are allocated once for `max_len` rows and reused by every job: a new job calls
`reset()`, which clears the data AND the lengths together (the seeds' "request 2 read stale rows"
bug came from clearing one without the other). Speculative decoding rolls rejected rows back with
`truncate()`: rows past `length` are never read, so moving the length is enough.
"""
from __future__ import annotations

import torch

from batchd.engine.config import ModelConfig
from batchd.engine.errors import PromptTooLongError


class KVCache:
    def __init__(self, config: ModelConfig, max_len: int, device, dtype: torch.dtype, batch_size: int = 1):
        shape = (batch_size, config.num_kv_heads, max_len, config.head_dim)
        # keys[i], values[i]: [B, Hkv, max_len, D] for layer i
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.max_len = max_len
        self.length = 0  # rows valid in every layer; the host is the source of truth
        # the same length on the device, for CUDA-graph replays that must not read host state
        self.length_on_device = torch.zeros(1, dtype=torch.long, device=device)
        # sparse attention: per-layer min/max key summaries per block (kernels.sparse_attention)
        self.block_summaries = None
        self.sparse_top_k = 0
        self.sparse_step = False  # the step being captured or replayed attends sparsely (StepRunner)

    def enable_sparse_attention(self, top_k_blocks: int, block_size: int = 64) -> None:
        """Keep per-block key summaries so decode and verify attend to the top-k blocks only."""
        from batchd.kernels.sparse_attention import BlockKeySummary

        self.block_summaries = [BlockKeySummary.for_cache(k, block_size=block_size) for k in self.keys]
        self.sparse_top_k = top_k_blocks

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def reserve(self, new_rows: int) -> None:
        """Check that `new_rows` more rows fit before writing them."""
        if self.length + new_rows > self.max_len:
            raise PromptTooLongError(
                f"{self.length + new_rows} tokens do not fit the {self.max_len}-token context; "
                "shorten the prompt, lower max_new_tokens or enable compression"
            )

    def advance(self, rows: int) -> None:
        self.length += rows
        self.length_on_device.fill_(self.length)

    def advanced_on_device(self, rows: int) -> None:
        """A replayed CUDA graph already added `rows` to length_on_device: follow on the host."""
        self.length += rows

    def truncate(self, length: int) -> None:
        """Forget rows from `length` on (rejected speculative rows)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} rows to {length}")
        self.length = length
        self.length_on_device.fill_(length)
        for summary in self.block_summaries or ():
            # a block's bounds may still cover rolled-back rows: looser, never wrong; the rows
            # written next recompute every block they touch
            summary.length = min(summary.length, length)

    def reset(self) -> None:
        """Clear data and lengths together, so job 2 sees exactly what a fresh cache shows."""
        for buffer in self.keys + self.values:
            buffer.zero_()
        for summary in self.block_summaries or ():
            summary.reset()
        self.truncate(0)
