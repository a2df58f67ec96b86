"""V4's cache for one batch of sequences that share a length: every part indexed by position.

Per layer (docs/deepseek_v4.md has the paged layout this maps onto):
- `rows` [B, max_len, D]: each position's shared key/value row (normed, rope'd). Attention reads
  the last `sliding_window` of them.
- for CSA and HCA layers, a `CompressorState` for the compressor (and, CSA only, one for the
  indexer): `kv`, `gate` [B, max_len, C], each position's compressor projections (C = D for HCA,
  2 D for CSA's two overlapping series), and `entries` [B, max_len // m, De], entry w made from
  positions [w m, (w + 1) m) (and, CSA, the window before) once they are all in.

Attention and the compressors reach each part through `read(first, end)` / `write(first, values)`
by index (`ContiguousStore` here; engine.deepseek_v4.paged stores the same parts in a block pool).

Everything is a function of the positions below `length`: entry w is valid iff (w + 1) m <= length,
and is recomputed from the stored projections whenever its window closes again. So rolling back a
rejected draft is moving `length` (`truncate`), for every part alike; transformers' cache, which
keeps the open window as a growing buffer and the entries as a concatenated list, cannot roll back
(its V4 layers are not croppable).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from batchd.engine.deepseek_v4.config import CSA, SLIDING, V4Config
from batchd.engine.errors import PromptTooLongError


class ContiguousStore:
    """Rows of one part for B sequences in one buffer [B, N, C], read and written by index."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def read(self, first: int, end: int) -> torch.Tensor:
        """-> [B, end - first, C]."""
        return self.tensor[:, first:end]

    def write(self, first: int, values: torch.Tensor) -> None:
        """values [B, n, C] -> indices [first, first + n)."""
        self.tensor[:, first : first + values.shape[1]] = values.to(self.tensor.dtype)


@dataclass
class CompressorState:
    """One compressor's rows: per-position projections and the entries made from them."""

    rate: int  # source positions per entry (m)
    kv: ContiguousStore  # by position: [B, max_len, C]
    gate: ContiguousStore  # by position: [B, max_len, C]
    entries: ContiguousStore  # by entry index: [B, max_len // m, De]

    @classmethod
    def empty(cls, rate: int, width: int, entry_dim: int, batch: int, max_len: int, device, dtype) -> "CompressorState":
        def zeros(*shape):
            return ContiguousStore(torch.zeros(shape, device=device, dtype=dtype))
        return cls(rate, zeros(batch, max_len, width), zeros(batch, max_len, width),
                   zeros(batch, max_len // rate, entry_dim))

    def tensors(self) -> list[torch.Tensor]:
        return [self.kv.tensor, self.gate.tensor, self.entries.tensor]


@dataclass
class LayerCache:
    rows: ContiguousStore  # by position: [B, max_len, D]
    compressor: Optional[CompressorState] = None
    indexer: Optional[CompressorState] = None

    def tensors(self) -> list[torch.Tensor]:
        parts = [self.rows.tensor]
        for state in (self.compressor, self.indexer):
            if state is not None:
                parts += state.tensors()
        return parts


class V4Cache:
    """Rows [0, length) are valid in every layer and every part; a step of T tokens calls
    `reserve(T)`, writes positions [length, length + T), then `advance(T)`."""

    def __init__(self, config: V4Config, max_len: int, device, dtype: torch.dtype, batch_size: int = 1):
        self.max_len, self.length = max_len, 0
        self.layers: list[LayerCache] = []
        for i, kind in enumerate(config.layer_types):
            layer = LayerCache(ContiguousStore(torch.zeros(batch_size, max_len, config.head_dim, device=device,
                                                          dtype=dtype)))
            if kind != SLIDING:
                rate = config.compress_rate(i)
                width = 2 * config.head_dim if kind == CSA else config.head_dim
                layer.compressor = CompressorState.empty(rate, width, config.head_dim, batch_size, max_len, device, dtype)
                if kind == CSA:
                    layer.indexer = CompressorState.empty(rate, 2 * config.index_head_dim, config.index_head_dim,
                                                          batch_size, max_len, device, dtype)
            self.layers.append(layer)

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].rows.tensor.dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].rows.tensor.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors())

    def reserve(self, new_rows: int) -> None:
        if self.length + new_rows > self.max_len:
            raise PromptTooLongError(
                f"{self.length + new_rows} tokens do not fit the {self.max_len}-token context; "
                "shorten the prompt or lower max_new_tokens")

    def advance(self, rows: int) -> None:
        self.length += rows

    def truncate(self, length: int) -> None:
        """Forget positions from `length` on (a rejected draft): raw rows, projections and the
        compressed entries of windows that no longer close, all by moving the length."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.length = length

    def reset(self) -> None:
        """Clear data and length together, so the next job sees exactly what a fresh cache shows."""
        for layer in self.layers:
            for tensor in layer.tensors():
                tensor.zero_()
        self.length = 0
