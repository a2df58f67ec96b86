"""rope_and_store: the fused Triton launch against the engine's eager ops (its reference twin)."""
from __future__ import annotations

import pytest
import torch

from batchd.kernels.rope_cache import rope_and_store, rope_and_store_reference
from tests.kernels.conftest import DEVICE, needs_triton, rel_err

CASES = [
    pytest.param(1, 1, 4, 2, 16, False, id="decode-gqa"),
    pytest.param(1, 5, 6, 2, 32, False, id="verify-q5"),
    pytest.param(2, 3, 4, 4, 16, True, id="qwen3-norm-mha"),
    pytest.param(2, 70, 4, 2, 64, False, id="prefill-row-blocks"),   # B * T >= 64: the row-block kernel
]


def make(B, T, Hq, Hkv, D, norm, dtype, S=None, seed=0):
    S = S or 3 * T + 8
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, (Hq + 2 * Hkv) * D, generator=g).to(dtype).to(DEVICE)
    angles = torch.rand(T, D // 2, generator=g) * 6
    cos, sin = torch.cat([angles, angles], -1).cos().to(DEVICE), torch.cat([angles, angles], -1).sin().to(DEVICE)
    positions = (torch.arange(T) * 3 + 7).to(DEVICE)  # not contiguous rows
    caches = [torch.zeros(B, Hkv, S, D, dtype=dtype, device=DEVICE) for _ in range(2)]
    norms = [torch.rand(D, generator=g).to(dtype).to(DEVICE) + 0.5 for _ in range(2)] if norm else [None, None]
    return qkv, cos, sin, positions, caches, norms


# the CPU interpreter rounds bf16 by truncation (triton 3.6), so bf16 is checked on CUDA only
LOW = torch.bfloat16 if DEVICE == "cuda" else torch.float16


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, LOW], ids=["f32", "half"])
@pytest.mark.parametrize("B, T, Hq, Hkv, D, norm", CASES)
def test_triton_matches_eager_ops(B, T, Hq, Hkv, D, norm, dtype):
    qkv, cos, sin, positions, (k1, v1), (qn, kn) = make(B, T, Hq, Hkv, D, norm, dtype)
    k2, v2 = k1.clone(), v1.clone()
    expected = rope_and_store_reference(qkv, cos, sin, positions, k1, v1, Hq, Hkv, qn, kn, 1e-6)
    got = rope_and_store(qkv, cos, sin, positions, k2, v2, Hq, Hkv, q_norm=qn, k_norm=kn, eps=1e-6, backend="triton")
    bound = 1e-6 if dtype == torch.float32 else 1e-2  # one rounding instead of the eager ops' several
    assert rel_err(got, expected) < bound
    assert rel_err(k2, k1) < bound
    assert torch.equal(v2, v1)  # values are copied, not computed
    untouched = torch.ones(k1.shape[2], dtype=torch.bool)
    untouched[positions.cpu()] = False
    assert k2[:, :, untouched.to(DEVICE)].abs().sum() == 0


def test_bad_shapes_name_the_numbers():
    qkv, cos, sin, positions, (k, v), _ = make(1, 2, 4, 2, 16, False, torch.float32)
    with pytest.raises(ValueError, match="qkv width"):
        rope_and_store(qkv[..., :-16], cos, sin, positions, k, v, 4, 2)


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, LOW], ids=["f32", "half"])
def test_row_block_kernel_equals_per_row_kernel(dtype):
    """The prefill grid (row blocks of one head) gives the decode grid's bits: 2 sequences of 130
    rows (two full blocks of 64 and a partial one), GQA heads, cache rows from 7 in steps of 3."""
    from batchd.kernels.rope_cache.triton_kernel import launch_per_row, launch_row_blocks, row_block_rows

    B, T, Hq, Hkv, D = 2, 130, 4, 2, 64
    assert T % row_block_rows(D) != 0
    qkv, cos, sin, positions, (k1, v1), _ = make(B, T, Hq, Hkv, D, False, dtype, seed=1)
    k2, v2 = k1.clone(), v1.clone()
    per_row = launch_per_row(qkv, cos, sin, positions, k1, v1, Hq, Hkv)
    blocks = launch_row_blocks(qkv, cos, sin, positions, k2, v2, Hq, Hkv)
    assert torch.equal(blocks, per_row)
    assert torch.equal(k2, k1)
    assert torch.equal(v2, v1)
