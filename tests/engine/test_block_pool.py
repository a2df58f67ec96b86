"""engine.batch.block_pool: reference counts, the free list, and prompt chunks shared by hash."""
from __future__ import annotations

import pytest

from batchd.engine.batch.block_pool import BlockPool, OutOfBlocks, chunk_hashes


def test_blocks_return_to_the_pool_when_their_last_holder_releases_them():
    pool = BlockPool(4, block_size=16)
    a = pool.allocate(3)
    assert pool.num_free == 1
    with pytest.raises(OutOfBlocks):
        pool.allocate(2)
    pool.release(a)
    assert pool.num_free == 4


def test_a_registered_chunk_is_shared_and_survives_its_first_owner():
    pool = BlockPool(6, block_size=16)
    owner = pool.allocate(2)
    h = chunk_hashes(list(range(40)), 32, 39)[0]
    pool.register_chunk(h, owner)
    pool.release(owner)                              # freed, but still findable
    assert pool.num_free == 6
    shared = pool.share_chunk(h, 2)
    assert shared == owner and pool.num_free == 4
    assert pool.share_chunk(h, 2) == owner and pool.refcount[owner[0]] == 2


def test_handing_a_block_out_again_forgets_its_chunk():
    pool = BlockPool(2, block_size=16)
    blocks = pool.allocate(2)
    h = chunk_hashes(list(range(40)), 32, 39)[0]
    pool.register_chunk(h, blocks)
    pool.release(blocks)
    pool.allocate(2)
    assert pool.share_chunk(h, 2) is None


def test_chunk_hashes_chain_every_chunk_before():
    a = chunk_hashes([1] * 64 + [2] * 32, 32, 96)
    b = chunk_hashes([1] * 32 + [3] * 32 + [2] * 32, 32, 96)
    assert len(a) == 3 and a[0] == b[0] and a[1] != b[1] and a[2] != b[2]
    assert chunk_hashes(list(range(63)), 32, 62) == chunk_hashes(list(range(63)), 32, 62)[:1]
