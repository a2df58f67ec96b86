"""kernels.paged_prefill: the Triton kernel against its PyTorch twin and against plain causal
attention, and a row's bits independent of the other chunks in the launch (batch invariance),
under the interpreter on the CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchd.kernels.paged_attention.reference import gather_rows
from batchd.kernels.paged_prefill import paged_prefill_attention, paged_prefill_attention_reference
from tests.kernels.conftest import DEVICE, REL_ERR, needs_triton, rel_err


def prefill_case(chunks, *, Hq=4, Hkv=2, D=32, block_size=16, dtype=torch.float32, seed=0):
    """chunks: (first position, rows) per chunk, each of its own sequence, whose blocks are
    scattered over a shared pool; q packs every chunk's rows."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(first + rows) // block_size) for first, rows in chunks]
    total = sum(blocks_per_seq) + 3
    k_pool = torch.randn(total, Hkv, block_size, D, generator=g).to(DEVICE, dtype)
    v_pool = torch.randn(total, Hkv, block_size, D, generator=g).to(DEVICE, dtype)
    order = torch.randperm(total, generator=g)
    tables, used = torch.zeros(len(chunks), max(blocks_per_seq), dtype=torch.int32), 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = order[used : used + n].to(torch.int32)
        used += n
    rows = [r for _, r in chunks]
    starts = [sum(rows[:i]) for i in range(len(rows))]
    q = torch.randn(sum(rows), Hq, D, generator=g).to(DEVICE, dtype)
    meta = [torch.tensor(x, dtype=torch.int32, device=DEVICE) for x in (starts, rows, [f for f, _ in chunks])]
    return q, k_pool, v_pool, tables.to(DEVICE), *meta


CHUNKS = [(0, 37), (16, 16), (64, 70), (5, 1), (130, 20)]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(4, 2, 32), (6, 2, 24), (3, 3, 16)], ids=["gqa2", "d24", "mha"])
def test_kernel_matches_reference(dtype, shape):
    Hq, Hkv, D = shape
    case = prefill_case(CHUNKS, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)
    out = paged_prefill_attention(*case, backend="triton")
    q, k, v, *rest = case
    expected = paged_prefill_attention_reference(q.float(), k.float(), v.float(), *rest, scale=D**-0.5)
    assert rel_err(out.float(), expected) < REL_ERR[dtype]


def test_reference_is_causal_attention_over_the_sequence():
    case = prefill_case([(24, 10)], Hq=4, Hkv=2, D=8, block_size=8)
    q, k, v, tables, starts, rows, firsts = (t.cpu() for t in case)   # float32 on the CPU: no TF32
    out = paged_prefill_attention_reference(q, k, v, tables, starts, rows, firsts, scale=8**-0.5)
    keys, values = gather_rows(k, tables[0], 34), gather_rows(v, tables[0], 34)     # [Hkv, 34, D]
    mask = torch.arange(34)[None, :] <= (24 + torch.arange(10))[:, None]            # [10, 34]
    expected = F.scaled_dot_product_attention(q.permute(1, 0, 2)[None], keys[None], values[None], attn_mask=mask,
                                              scale=8**-0.5, enable_gqa=True)[0].permute(1, 0, 2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@needs_triton
def test_row_bits_do_not_depend_on_the_other_chunks():
    q, k, v, tables, starts, rows, firsts = prefill_case(CHUNKS)
    together = paged_prefill_attention(q, k, v, tables, starts, rows, firsts, backend="triton")
    for c in range(len(CHUNKS)):
        a, n = int(starts[c]), int(rows[c])
        alone = paged_prefill_attention(q[a : a + n], k, v, tables[c : c + 1], torch.zeros_like(starts[:1]),
                                        rows[c : c + 1], firsts[c : c + 1], backend="triton")
        assert torch.equal(alone, together[a : a + n]), c
