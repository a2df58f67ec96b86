"""The KV-cache interface (`KVCache`) and its one implementation today, `ContiguousKVCache`.

`KVCache` is what the model, attention, the step runner, speculation and residency use of a
cache. `ContiguousKVCache` keeps one preallocated [B, Hkv, max_len, D] buffer per layer for one
sequence. The interface is written so that the caches the next changes need fit behind it:

- a paged cache (many sequences, fixed-size blocks, per-sequence block tables): `length`,
  `reserve`/`advance`/`truncate`/`reset` become per sequence (a sequence id, or the batch's
  current sequences), and `keys[i]`/`values[i]` give attention what it reads: the layer's block
  pool, read through the tables (a view object rather than one contiguous tensor);
- a latent (MLA-style) cache: one compressed latent per row and layer instead of per-head keys
  and values; `keys[i]`/`values[i]` are then the latents (and their rope part) that the
  attention kernel expands with the layer's up-projections, and `nbytes` counts the latents.

ContiguousKVCache: buffers are allocated once for `max_len` rows and reused by every job: a new job calls
`reset()`, which clears the data AND the lengths together (the seeds' "request 2 read stale rows"
bug came from clearing one without the other). Speculative decoding rolls rejected rows back with
`truncate()`: rows past `length` are never read, so moving the length is enough.
"""
from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch

from batchd.engine.config import ModelConfig
from batchd.engine.errors import PromptTooLongError
from batchd.kernels.sparse_attention import BlockKeySummary


@runtime_checkable
class KVCache(Protocol):
    """The rows of keys and values a model step reads and appends to.

    Rows [0, length) are valid in every layer; a step of T tokens calls `reserve(T)`, writes its
    rows at positions [length, length + T) of each layer, then `advance(T)`.
    """

    max_len: int  # rows the cache can hold (per sequence)
    length: int  # rows valid in every layer; the host's copy is the source of truth
    # the same length on the device [1] long, so a replayed CUDA graph reads no host state
    length_on_device: torch.Tensor
    # per layer: the tensors attention reads and the step writes ([B, Hkv, max_len, D] each for
    # the contiguous cache); indexable by layer
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    # sparse attention's per-block key summaries per layer, or None (dense attention only)
    block_summaries: Optional[list]
    sparse_top_k: int  # blocks each sparse step attends to (0: dense)
    sparse_step: bool  # the step being captured or replayed attends sparsely (StepRunner)

    @property
    def dtype(self) -> torch.dtype:
        """The element type of stored keys and values."""

    @property
    def device(self) -> torch.device: ...

    @property
    def nbytes(self) -> int:
        """Device bytes the cache holds (what parking frees)."""

    def reserve(self, new_rows: int) -> None:
        """Raise PromptTooLongError unless `new_rows` more rows fit (a paged cache allocates
        blocks here)."""

    def advance(self, rows: int) -> None:
        """`rows` rows were written after `length`: they are valid now (host and device length)."""

    def advanced_on_device(self, rows: int) -> None:
        """A replayed CUDA graph advanced `length_on_device` by `rows`: follow on the host."""

    def truncate(self, length: int) -> None:
        """Forget rows from `length` on (speculation's rejected rows; a paged cache frees the
        blocks wholly past it)."""

    def reset(self) -> None:
        """Empty the cache for a new job: data and lengths together."""

    def enable_sparse_attention(self, top_k_blocks: int, block_size: int = 64) -> None:
        """Keep per-block key summaries so decode and verify attend to the top-k blocks only."""


class ContiguousKVCache:
    """One sequence batch's rows in one preallocated buffer per layer (implements `KVCache`)."""

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
