"""score_tail_queries: the two-pass Triton kernel against the materialising reference."""
from __future__ import annotations

import math

import pytest
import torch

from batchd.kernels import score_tail_queries
from batchd.kernels.chunk_scoring import score_tail_queries_reference
from tests.kernels.conftest import DEVICE, needs_triton, rel_err


def make(Hq, Hkv, T, D, S, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (2 * torch.randn(Hq, T, D, generator=g)).to(dtype).to(DEVICE)     # peaked softmax: scores differ
    k = torch.randn(Hkv, S, D, generator=g).to(dtype).to(DEVICE)
    return q, k


def test_reference_matches_definition():
    q, k = make(4, 2, 3, 8, 20, torch.float32)
    S, T = 20, 3
    probs = torch.zeros(4, T, S, dtype=torch.float64)
    for h in range(4):
        for t in range(T):
            pos = S - T + t
            logits = k[h // 2, : pos + 1].double() @ q[h, t].double() / math.sqrt(8)
            probs[h, t, : pos + 1] = torch.softmax(logits, 0)
    want = probs.mean(1).amax(0)
    assert rel_err(score_tail_queries_reference(q.cpu(), k.cpu(), 1 / math.sqrt(8), torch.float64), want) < 1e-6   # rounded to float32


def test_one_head_scores_sum_to_one():
    q, k = make(1, 1, 8, 16, 100, torch.float32)
    assert abs(score_tail_queries(q, k, backend="reference").sum().item() - 1.0) < 1e-5


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("Hq, Hkv, T, D, S", [
    pytest.param(4, 4, 8, 32, 256, id="g1-t8-edge"),
    pytest.param(6, 2, 8, 32, 300, id="g3-t8-inside"),
    pytest.param(16, 8, 8, 64, 130, id="qwen3-0.6b-heads"),
    pytest.param(8, 1, 1, 32, 64, id="g8-t1-one-block"),
    pytest.param(12, 3, 5, 32, 97, id="g4-t5"),
])
def test_triton_matches_reference(Hq, Hkv, T, D, S, dtype):
    q, k = make(Hq, Hkv, T, D, S, dtype)
    got = score_tail_queries(q, k, backend="triton")
    want = score_tail_queries_reference(q, k, 1 / math.sqrt(D), torch.float64)
    assert got.dtype == torch.float32 and got.shape == (S,)
    assert rel_err(got, want) < 1e-5


@needs_triton
@pytest.mark.triton
def test_triton_works_on_a_cache_view():
    # the PFlash observer hands views of the cache: [B, Hkv, S_max, D][0, :, :S]
    cache = torch.randn(1, 2, 200, 32, dtype=torch.bfloat16, device=DEVICE)
    q, _ = make(4, 2, 8, 32, 150, torch.bfloat16)
    k = cache[0, :, :150]
    want = score_tail_queries_reference(q, k.contiguous(), 1 / math.sqrt(32), torch.float64)
    assert rel_err(score_tail_queries(q, k, backend="triton"), want) < 1e-5


@pytest.mark.parametrize("q_shape, k_shape, message", [
    ((4, 8, 32), (3, 100, 32), r"query heads \(4\) must be a multiple of KV heads \(3\)"),
    ((4, 8, 32), (2, 100, 16), "head dim 32 != k head dim 16"),
    ((4, 8, 32), (2, 5, 32), r"tail rows must be in 1..min\(S=5, 64\), got 8"),
])
def test_bad_shapes_name_the_numbers(q_shape, k_shape, message):
    with pytest.raises(ValueError, match=message):
        score_tail_queries(torch.zeros(q_shape), torch.zeros(k_shape))
