"""Our logits against transformers' in float32 on tiny random checkpoints of every architecture."""
from __future__ import annotations

import pytest
import torch

from batchd.engine.kv_cache import ContiguousKVCache
from tests.engine.tiny_models import ARCHITECTURES, hf_model, ours_from_hf

pytest.importorskip("transformers")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(params=sorted(ARCHITECTURES))
def pair(request):
    hf = hf_model(request.param)
    return hf, ours_from_hf(hf)


def new_cache(model, max_len=128):
    return ContiguousKVCache(model.config, max_len, "cpu", torch.float32)


def test_prefill_logits_match(pair):
    hf, ours = pair
    tokens = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens, new_cache(ours))
    assert relative_error(got, expected) < 1e-4


def test_chunked_prefill_then_decode_and_verify_match(pair):
    hf, ours = pair
    tokens = torch.randint(0, 512, (1, 60), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(tokens).logits
        cache = new_cache(ours)
        chunks = [ours(tokens[:, :17], cache), ours(tokens[:, 17:40], cache)]  # chunked prefill
        chunks += [ours(tokens[:, i : i + 1], cache) for i in range(40, 44)]  # decode
        chunks.append(ours(tokens[:, 44:52], cache))  # verify of q=8 rows
        chunks.append(ours(tokens[:, 52:60], cache))
        got = torch.cat(chunks, dim=1)
    assert cache.length == 60
    assert relative_error(got, expected) < 1e-4


def test_truncate_rolls_back_rejected_rows(pair):
    _, ours = pair
    tokens = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cache = new_cache(ours)
        ours(tokens[:, :20], cache)
        ours(torch.randint(0, 512, (1, 6)), cache)  # a rejected draft
        cache.truncate(20)
        after_rollback = ours(tokens[:, 20:], cache)
        fresh = new_cache(ours)
        ours(tokens[:, :20], fresh)
        expected = ours(tokens[:, 20:], fresh)
    torch.testing.assert_close(after_rollback, expected, rtol=0, atol=0)


def test_request_two_matches_fresh_cache(pair):
    _, ours = pair
    a = torch.randint(0, 512, (1, 50), generator=torch.Generator().manual_seed(4))
    b = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        cache = new_cache(ours)
        ours(a, cache)
        cache.reset()
        assert cache.length == 0 and all(k.abs().sum() == 0 for k in cache.keys)
        second = ours(b, cache)
        first_on_fresh = ours(b, new_cache(ours))
    torch.testing.assert_close(second, first_on_fresh, rtol=0, atol=0)
