"""rope_paged_store: the one-launch rope + paged-pool write against the batch engine's eager ops."""
from __future__ import annotations

import pytest
import torch

from batchd.kernels.rope_paged import rope_paged_store, rope_paged_store_reference
from tests.kernels.conftest import DEVICE, needs_triton

BLOCK_SIZE, BLOCKS = 4, 80   # pools [BLOCKS + 1, Hkv, BLOCK_SIZE, D]; block BLOCKS is the spare one
# the CPU interpreter rounds bf16 by truncation (triton 3.6), so bf16 is checked on CUDA only
DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.float16, id="f16"),
          pytest.param(torch.bfloat16, id="bf16",
                       marks=pytest.mark.skipif(DEVICE != "cuda", reason="the interpreter truncates bf16"))]
SHAPES = [
    pytest.param(1, 4, 2, 64, id="decode-1-row"),
    pytest.param(7, 4, 2, 128, id="7-rows-d128"),
    pytest.param(130, 4, 2, 64, id="130-rows"),      # two full row blocks and a partial one
    pytest.param(5, 3, 1, 96, id="d96-odd-heads"),  # a head dim that is no power of two
]


def make_rows(N, Hq, Hkv, D, dtype, pads=0, seed=0):
    """q, k, v views of fused rows [N, (Hq + 2 Hkv) D]; cos, sin [N, 1, D] float32; pools; each real
    row's own slot in a scattered block (the last `pads` rows are padding: the spare block, offset 0)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(N, (Hq + 2 * Hkv) * D, generator=g).to(dtype).to(DEVICE)
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.view(N, Hq, D), k.view(N, Hkv, D), v.view(N, Hkv, D)
    angles = torch.rand(N, 1, D // 2, generator=g) * 60
    cos, sin = (torch.cat([angles, angles], -1).cos().to(DEVICE), torch.cat([angles, angles], -1).sin().to(DEVICE))
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=g)[: N - pads]
    blocks = torch.cat([slots // BLOCK_SIZE, torch.full((pads,), BLOCKS)]).to(DEVICE)
    offsets = torch.cat([slots % BLOCK_SIZE, torch.zeros(pads, dtype=torch.long)]).to(DEVICE)
    pools = [torch.randn(BLOCKS + 1, Hkv, BLOCK_SIZE, D, generator=g).to(dtype).to(DEVICE) for _ in range(2)]
    return q, k, v, cos, sin, pools, blocks, offsets


def run_both(q, k, v, cos, sin, pools, blocks, offsets):
    """(reference q, its pools), (kernel q, its pools), from the same starting pools."""
    ref_pools = [p.clone() for p in pools]
    got_pools = [p.clone() for p in pools]
    expected = rope_paged_store_reference(q, k, v, cos, sin, *ref_pools, blocks, offsets)
    got = rope_paged_store(q, k, v, cos, sin, *got_pools, blocks, offsets, backend="triton")
    return (expected, ref_pools), (got, got_pools)


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, Hq, Hkv, D", SHAPES)
def test_kernel_equals_eager_ops_bit_for_bit(N, Hq, Hkv, D, dtype):
    q, k, v, cos, sin, pools, blocks, offsets = make_rows(N, Hq, Hkv, D, dtype)
    (expected, (k_ref, v_ref)), (got, (k_got, v_got)) = run_both(q, k, v, cos, sin, pools, blocks, offsets)
    assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert torch.equal(k_got, k_ref)
    assert torch.equal(v_got, v_ref)


@needs_triton
@pytest.mark.triton
def test_untouched_slots_keep_their_values():
    q, k, v, cos, sin, (k_pool, v_pool), blocks, offsets = make_rows(7, 4, 2, 64, torch.float32)
    k_before, v_before = k_pool.clone(), v_pool.clone()
    rope_paged_store(q, k, v, cos, sin, k_pool, v_pool, blocks, offsets, backend="triton")
    written = torch.zeros(BLOCKS + 1, BLOCK_SIZE, dtype=torch.bool, device=DEVICE)
    written[blocks, offsets] = True
    assert torch.equal(k_pool.transpose(1, 2)[~written], k_before.transpose(1, 2)[~written])
    assert torch.equal(v_pool.transpose(1, 2)[~written], v_before.transpose(1, 2)[~written])
    assert not torch.equal(k_pool.transpose(1, 2)[written], k_before.transpose(1, 2)[written])


@needs_triton
@pytest.mark.triton
def test_padding_rows_write_only_the_spare_block():
    """A CUDA-graph step's padding rows all point at (pad block, 0): the real rows' slots and the rest
    of the pool are as the eager ops leave them; each value in the spare slot is one padding row's
    (the rows race for it: each head's program, and each thread in it, may take another row's)."""
    pads = 3
    q, k, v, cos, sin, pools, blocks, offsets = make_rows(9, 4, 2, 64, torch.float16, pads=pads, seed=2)
    (expected, (k_ref, v_ref)), (got, (k_got, v_got)) = run_both(q, k, v, cos, sin, pools, blocks, offsets)
    assert torch.equal(got, expected)
    assert torch.equal(k_got[:BLOCKS], k_ref[:BLOCKS]) and torch.equal(v_got[:BLOCKS], v_ref[:BLOCKS])
    assert torch.equal(k_got[BLOCKS, :, 1:], pools[0][BLOCKS, :, 1:])
    padding_values = v[9 - pads:]                                  # [pads, kv heads, head_dim]
    assert (padding_values == v_got[BLOCKS, :, 0][None]).any(dim=0).all()


@needs_triton
@pytest.mark.triton
def test_normed_rows_and_a_pool_of_another_dtype():
    """qwen3 hands contiguous normed q and k (not views of the fused rows); a float32 model may keep
    a float16 pool: k is rotated in float32 and then cast, v cast, as PagedKVCache.write does."""
    q, k, v, cos, sin, pools, blocks, offsets = make_rows(7, 4, 2, 64, torch.float32, seed=3)
    pools = [p.to(torch.float16) for p in pools]
    (expected, (k_ref, v_ref)), (got, (k_got, v_got)) = run_both(q.contiguous(), k.contiguous(), v, cos[:, 0],
                                                                 sin[:, 0], pools, blocks, offsets)
    assert torch.equal(got, expected)
    assert torch.equal(k_got, k_ref) and torch.equal(v_got, v_ref)


def test_mismatched_inputs_name_the_numbers():
    q, k, v, cos, sin, (k_pool, v_pool), blocks, offsets = make_rows(3, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match=r"pools \[81, 2, 4, 16\].*\[blocks \+ 1, 1, block_size, 16\]"):
        rope_paged_store(q, k[:, :1], v[:, :1], cos, sin, k_pool, v_pool, blocks, offsets)
    with pytest.raises(ValueError, match=r"cos \[2, 1, 16\] must be \[3, 16\]"):
        rope_paged_store(q, k, v, cos[:2], sin, k_pool, v_pool, blocks, offsets)
    with pytest.raises(ValueError, match=r"write_offsets must be an integer tensor \[3\]"):
        rope_paged_store(q, k, v, cos, sin, k_pool, v_pool, blocks, offsets.float())
