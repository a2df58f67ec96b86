"""Per-block key summaries for one layer's cache: the min and max of K over each block of rows."""
from __future__ import annotations

import torch

from batchd.kernels._backend import resolve_backend


class BlockKeySummary:
    """kmin, kmax: [B, Hkv, n_blocks, D] in the cache's dtype (min/max of bf16 values are exact).

    Block j covers cache rows [j * block_size, (j + 1) * block_size). `update(k_cache, old_len, new_len)`
    recomputes every block that rows [old_len, new_len) touch, from the cache rows below new_len, so it
    is also right after a rollback (truncate) or a reset: pass the length the rows were written at.
    Blocks at or past `length` hold stale values; the selection never looks at them.
    """

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, *, block_size: int = 64,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu") -> None:
        if block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
        n_blocks = -(-max_len // block_size)
        self.block_size = block_size
        self.max_len = max_len
        self.kmin = torch.zeros(batch, kv_heads, n_blocks, head_dim, dtype=dtype, device=device)
        self.kmax = torch.zeros(batch, kv_heads, n_blocks, head_dim, dtype=dtype, device=device)
        self.length = 0

    @classmethod
    def for_cache(cls, k_cache: torch.Tensor, *, block_size: int = 64) -> "BlockKeySummary":
        """An empty summary shaped for k_cache [B, Hkv, S_max, D]."""
        B, Hkv, S_max, D = k_cache.shape
        return cls(B, Hkv, S_max, D, block_size=block_size, dtype=k_cache.dtype, device=k_cache.device)

    @property
    def n_blocks(self) -> int:
        return self.kmin.shape[2]

    def update(self, k_cache: torch.Tensor, old_len: int, new_len: int, *, backend: str = "auto") -> None:
        """Bring the blocks holding rows [old_len, new_len) up to date; afterwards length == new_len.

        backend "auto": one Triton launch on CUDA, the PyTorch twin (a few reductions) elsewhere.
        """
        B, Hkv, S_max, D = k_cache.shape
        if (B, Hkv, D) != (self.kmin.shape[0], self.kmin.shape[1], self.kmin.shape[3]) or S_max > self.max_len:
            raise ValueError(f"k_cache {list(k_cache.shape)} does not fit a summary of {list(self.kmin.shape)} "
                             f"blocks of {self.block_size} rows")
        if not 0 <= old_len <= S_max or not 0 <= new_len <= S_max:
            raise ValueError(f"old_len ({old_len}) and new_len ({new_len}) must be in 0..{S_max}")
        if new_len > old_len and resolve_backend(backend, k_cache.device) == "triton":
            from batchd.kernels.sparse_attention.triton_kernel import summary_update_triton

            if k_cache.stride(-1) != 1:
                raise ValueError(f"k_cache must be contiguous in its head dim, got strides {k_cache.stride()}")
            summary_update_triton(k_cache, self.kmin, self.kmax, self.block_size, old_len, new_len)
        elif new_len > old_len:
            bs = self.block_size
            first = old_len // bs
            start = first * bs
            n_full = (new_len - start) // bs
            if n_full:
                blocks = k_cache[:, :, start:start + n_full * bs].unflatten(2, (n_full, bs))   # [B, Hkv, n, bs, D]
                self.kmin[:, :, first:first + n_full] = blocks.amin(dim=3)
                self.kmax[:, :, first:first + n_full] = blocks.amax(dim=3)
            tail_start = start + n_full * bs
            if tail_start < new_len:                                       # a partly written last block
                tail = k_cache[:, :, tail_start:new_len]
                self.kmin[:, :, first + n_full] = tail.amin(dim=2)
                self.kmax[:, :, first + n_full] = tail.amax(dim=2)
        self.length = new_len

    def update_on_device(self, k_cache: torch.Tensor, start: torch.Tensor, rows: int, *, backend: str = "auto") -> None:
        """`update(k_cache, start, start + rows)` with `start` ([1] int64) read on the device, so a CUDA
        graph can replay it at any length. The caller keeps `length` in step (it is host state)."""
        if resolve_backend(backend, k_cache.device) == "triton":
            from batchd.kernels.sparse_attention.triton_kernel import summary_update_at_triton

            summary_update_at_triton(k_cache, self.kmin, self.kmax, self.block_size, start, rows)
            return
        first = int(start.reshape(-1)[0])  # the reference runs eagerly, where a read-back is fine
        self.update(k_cache, first, first + rows, backend="reference")

    def reset(self) -> None:
        self.length = 0
