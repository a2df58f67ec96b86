"""kernels.paged_attention: the Triton kernel against its PyTorch twin, and a row's bits independent
of the other rows in the launch (batch invariance), under the interpreter on the CPU."""
from __future__ import annotations

import pytest
import torch

from batchd.kernels.paged_attention import paged_decode_attention, paged_decode_attention_reference
from tests.kernels.conftest import DEVICE, REL_ERR, needs_triton, rel_err


def paged_case(lengths, *, Hq=4, Hkv=2, D=32, block_size=16, dtype=torch.float32, seed=0):
    """Random pools with each sequence's blocks scattered over the pool in a shuffled order."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in lengths]
    total = sum(blocks_per_seq) + 3
    k_pool = torch.randn(total, Hkv, block_size, D, generator=g).to(DEVICE, dtype)
    v_pool = torch.randn(total, Hkv, block_size, D, generator=g).to(DEVICE, dtype)
    order = torch.randperm(total, generator=g)
    width = max(blocks_per_seq)
    tables, used = torch.zeros(len(lengths), width, dtype=torch.int32), 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = order[used : used + n].to(torch.int32)
        used += n
    q = torch.randn(len(lengths), Hq, D, generator=g).to(DEVICE, dtype)
    lens = torch.tensor(lengths, dtype=torch.int32)
    return q, k_pool, v_pool, tables.to(DEVICE), lens.to(DEVICE)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(4, 2, 32), (6, 2, 24), (3, 3, 16)], ids=["gqa2", "d24", "mha"])
def test_kernel_matches_reference(dtype, shape):
    Hq, Hkv, D = shape
    q, k, v, tables, lens = paged_case([1, 17, 40, 130], Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)
    out = paged_decode_attention(q, k, v, tables, lens, split_blocks=2, backend="triton")
    expected = paged_decode_attention_reference(q.float(), k.float(), v.float(), tables, lens, scale=D**-0.5)
    assert rel_err(out.float(), expected) < REL_ERR[dtype]


@needs_triton
def test_row_bits_do_not_depend_on_the_batch():
    q, k, v, tables, lens = paged_case([5, 33, 70, 100, 64])
    together = paged_decode_attention(q, k, v, tables, lens, split_blocks=2, backend="triton")
    for n in range(len(lens)):
        alone = paged_decode_attention(q[n : n + 1], k, v, tables[n : n + 1], lens[n : n + 1], split_blocks=2,
                                       max_seq_len=int(lens[n]), backend="triton")
        assert torch.equal(alone[0], together[n]), n
    reordered = torch.tensor([4, 2, 0, 3, 1], device=q.device)
    shuffled = paged_decode_attention(q[reordered], k, v, tables[reordered], lens[reordered], split_blocks=2,
                                      backend="triton")
    assert torch.equal(shuffled, together[reordered])


def test_reference_is_plain_attention_over_the_gathered_rows():
    q, k, v, tables, lens = paged_case([20], Hq=2, Hkv=1, D=8, block_size=8)
    out = paged_decode_attention_reference(q, k, v, tables, lens, scale=0.5)
    keys = torch.cat([k[int(b), 0] for b in tables[0, :3]])[:20]
    values = torch.cat([v[int(b), 0] for b in tables[0, :3]])[:20]
    expected = torch.softmax(q[0] @ keys.T * 0.5, -1) @ values
    torch.testing.assert_close(out[0], expected)


def test_bad_shapes_name_the_numbers():
    q, k, v, tables, lens = paged_case([4, 8])
    with pytest.raises(ValueError, match=r"seq_lens \[N\] for N = 2"):
        paged_decode_attention(q, k, v, tables, lens[:1])
