"""The engine with sparse attention: exact where the rule says dense, the selected blocks where
sparse, and rollback/reset keep the block summaries consistent with the cache."""
from __future__ import annotations

import pytest
import torch

from batchd.engine.runtime import Engine, EngineConfig
from batchd.engine.types import GenerationRequest, SamplingParams
from tests.engine.tiny_models import hf_model, ours_from_hf

pytest.importorskip("transformers")


def engines(top_k_blocks: int = 4):
    model = ours_from_hf(hf_model("llama"))
    dense = Engine(model, None, EngineConfig(max_context=1024), eos_ids=set())
    sparse = Engine(model, None, EngineConfig(max_context=1024, attention="sparse",
                    sparse_top_k_blocks=top_k_blocks), eos_ids=set())
    return dense, sparse


def greedy(engine: Engine, prompt: list[int], n: int = 16) -> list[int]:
    request = GenerationRequest(sampling=SamplingParams(max_new_tokens=n, ignore_eos=True))
    return engine.generate_ids(prompt, request).token_ids


def prompt_of(length: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_sparse_engine_is_exact_where_the_rule_says_dense():
    dense, sparse = engines(top_k_blocks=4)  # sparse only past 2 * 4 * 64 = 512 visible rows
    prompt = prompt_of(120)
    assert greedy(sparse, prompt) == greedy(dense, prompt)


def test_sparse_engine_attends_to_selected_blocks_at_long_context():
    dense, sparse = engines(top_k_blocks=4)
    prompt = prompt_of(700, seed=1)
    with torch.inference_mode():
        for engine in (dense, sparse):
            engine.cache.reset()
            engine.model(torch.tensor([prompt[:690]]), engine.cache)
        dense_logits = dense.model(torch.tensor([prompt[690:]]), dense.cache)
        sparse_logits = sparse.model(torch.tensor([prompt[690:]]), sparse.cache)
    assert sparse.cache.block_summaries[0].length == 700
    # sparse drops rows, so logits move (which rows it keeps is pinned by tests/kernels)
    assert torch.isfinite(sparse_logits).all()
    assert not torch.equal(sparse_logits, dense_logits)


def test_rollback_and_reset_keep_summaries_in_step():
    _, sparse = engines(top_k_blocks=4)
    prompt = prompt_of(600, seed=2)
    with torch.inference_mode():
        sparse.cache.reset()
        sparse.model(torch.tensor([prompt[:590]]), sparse.cache)
        sparse.model(torch.tensor([prompt_of(6, seed=9)]), sparse.cache)  # a rejected draft
        sparse.cache.truncate(590)
        after_rollback = sparse.model(torch.tensor([prompt[590:]]), sparse.cache)
        sparse.cache.reset()
        assert all(s.length == 0 for s in sparse.cache.block_summaries)
        sparse.model(torch.tensor([prompt[:590]]), sparse.cache)
        fresh = sparse.model(torch.tensor([prompt[590:]]), sparse.cache)
    torch.testing.assert_close(after_rollback, fresh, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("start", [300, 505, 700], ids=["dense-rule", "across-the-rule", "sparse-rule"])
def test_verify_rows_equal_decode_steps_with_sparse_attention_on_cpu(start):
    """Speculation must not change greedy output with --attention sparse either: each row of an
    8-token verify step is bitwise the logits of the one-token step at its position, where the
    rule says dense (every lane exact), across it (lanes 0..6 at most 512 rows, lane 7 past it),
    and where it says sparse."""
    _, sparse = engines(top_k_blocks=4)  # keep_all_rows = 2 * 4 * 64 = 512
    tokens = torch.tensor([prompt_of(start + 8, seed=4)])
    with torch.inference_mode():
        sparse.cache.reset()
        sparse.model(tokens[:, :start], sparse.cache)
        one_by_one = torch.cat([sparse.model(tokens[:, t : t + 1], sparse.cache) for t in range(start, start + 8)], 1)
        sparse.cache.truncate(start)
        verified = sparse.model(tokens[:, start:], sparse.cache)
    assert torch.equal(verified, one_by_one)
