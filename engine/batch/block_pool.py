"""Fixed-size KV blocks: a free list, reference counts, and prompt prefixes shared by hash.

A block holds `block_size` positions of one sequence in every layer (engine.batch.paged_cache).
Sharing is by whole prefill chunks: a prompt's chunk k is known by the chained hash of its tokens
and every chunk before it, and a sequence whose prompt starts with the same chunks takes their
blocks (reference-counted) instead of computing them. Chunks, not single blocks, because a prompt
row's bits depend on the shape of the chunk it was computed in (the library GEMM and attention
pick kernels by shape): a full chunk at a fixed offset is computed alike by every sequence.

Freed blocks that still hold a registered chunk stay findable until they are handed out again
(least recently freed first), so a template shared by consecutive jobs is computed once.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from typing import Optional


class OutOfBlocks(Exception):
    """The pool has fewer free blocks than asked for; the scheduler preempts or waits."""


def chunk_hashes(tokens: list[int], chunk: int, limit: int) -> list[bytes]:
    """Chained digests of the full `chunk`-token chunks of `tokens` that end at or before `limit`
    (BLAKE2b: a collision would hand a sequence another prompt's keys, so no 64-bit hash)."""
    hashes, running = [], b""
    for start in range(0, limit - chunk + 1, chunk):
        piece = tokens[start : start + chunk]
        running = hashlib.blake2b(running + struct.pack(f"<{len(piece)}q", *piece), digest_size=16).digest()
        hashes.append(running)
    return hashes


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refcount = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._key_of: dict[int, tuple[bytes, int]] = {}        # block -> (chunk hash, index in chunk)
        self._block_of: dict[tuple[bytes, int], int] = {}      # (chunk hash, index in chunk) -> block

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"{n} blocks asked, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            key = self._key_of.pop(block, None)
            if key is not None:
                del self._block_of[key]
            self.refcount[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            self.refcount[block] -= 1
            assert self.refcount[block] >= 0, f"block {block} released more often than taken"
            if self.refcount[block] == 0:
                self._free[block] = None

    # ---- prefix sharing --------------------------------------------------------------------

    def register_chunk(self, chunk_hash: bytes, blocks: list[int]) -> None:
        """`blocks` now hold the chunk known by `chunk_hash` (its KV rows are written)."""
        for i, block in enumerate(blocks):
            key = (chunk_hash, i)
            if key not in self._block_of:
                self._block_of[key] = block
                self._key_of[block] = key

    def share_chunk(self, chunk_hash: bytes, blocks_per_chunk: int) -> Optional[list[int]]:
        """The blocks of a registered chunk, each taken once more; None if it is not (all) here."""
        blocks = [self._block_of.get((chunk_hash, i)) for i in range(blocks_per_chunk)]
        if any(b is None for b in blocks):
            return None
        for block in blocks:
            if self.refcount[block] == 0:
                del self._free[block]
            self.refcount[block] += 1
        return blocks
