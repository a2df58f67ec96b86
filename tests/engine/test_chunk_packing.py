"""Which prompt chunks join the packed pass (engine.batch.chunks.ChunkPacking), and the fixed-slab
projection it runs (engine.batch.rows.project_slabs)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from batchd.engine.batch.chunks import CHUNK_SLAB_ROWS, PACKED_FIRST_TOKENS, ChunkPacking
from batchd.engine.batch.rows import project_slabs


def test_packing_is_on_for_cuda_off_for_the_cpu_and_zero_turns_it_off():
    assert ChunkPacking.for_device("cuda", None).slab_rows == CHUNK_SLAB_ROWS
    assert ChunkPacking.for_device("cpu", None).slab_rows is None
    assert ChunkPacking.for_device("cuda", 0).slab_rows is None
    assert ChunkPacking.for_device("cpu", 32).slab_rows == 32


def test_the_path_follows_from_the_chunk_alone():
    packed, per_chunk = ChunkPacking(slab_rows=1024), ChunkPacking()
    assert packed.in_pass(0, PACKED_FIRST_TOKENS) and not packed.in_pass(0, PACKED_FIRST_TOKENS + 1)
    assert packed.in_pass(4096, 8192) and per_chunk.in_pass(4096, 8192)   # continuing chunks: always
    assert not per_chunk.in_pass(0, 64)                                   # first chunks: the one-sequence prefill


def test_slabs_cover_every_row_with_and_without_bias():
    torch.manual_seed(0)
    x, weight, bias = torch.randn(70, 24), torch.randn(40, 24), torch.randn(40)
    for b in (None, bias):
        out = project_slabs(x, weight, b, 32)                 # 3 slabs, the last with 26 padding rows
        assert out.shape == (70, 40)
        torch.testing.assert_close(out, F.linear(x, weight, b))
        # each slab is one GEMM of exactly 32 rows: the first two equal their own 32-row calls
        assert torch.equal(out[:32], F.linear(x[:32], weight, b))
        assert torch.equal(out[32:64], F.linear(x[32:64], weight, b))
