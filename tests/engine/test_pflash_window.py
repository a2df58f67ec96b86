"""PFlash's windowed scoring prefill (engine.pflash.window) against exact and masked references."""
from __future__ import annotations

import random

import pytest
import torch

from batchd.engine.attention import attend
from batchd.engine.kv_cache import ContiguousKVCache, KVCache
from batchd.engine.pflash.scoring import score_prompt, score_tail
from batchd.engine.pflash.window import ScoringWindow, prefill_windowed
from tests.engine.tiny_models import hf_model, ours_from_hf

SMALL = ScoringWindow(window=32, block=16, sink=4)  # exact up to 48 tokens


def random_ids(n: int, seed: int, vocab: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def exact_attention(q, k_cache, v_cache, start, scale):
    return attend(q, k_cache, v_cache, start, scale, use_kernel=False)


def prefilled(model, ids, attention, chunk, max_len=None) -> KVCache:
    cache = ContiguousKVCache(model.config, max_len or len(ids), model.device, model.dtype)
    tokens = torch.tensor([ids])
    for begin in range(0, len(ids), chunk):
        prefill_windowed(model, tokens[:, begin : begin + chunk], cache, attention)
    return cache


def assert_same_cache(a: KVCache, b: KVCache, exact: bool = False):
    for layer, (ka, kb, va, vb) in enumerate(zip(a.keys, b.keys, a.values, b.values)):
        if exact:
            assert torch.equal(ka, kb) and torch.equal(va, vb), f"layer {layer}"
        else:
            torch.testing.assert_close(ka, kb, rtol=1e-5, atol=1e-5, msg=f"keys, layer {layer}")
            torch.testing.assert_close(va, vb, rtol=1e-5, atol=1e-5, msg=f"values, layer {layer}")


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request):
    return ours_from_hf(hf_model(request.param))


def test_visible_keys_follow_the_rule():
    w = ScoringWindow(window=4, block=2, sink=1)
    mask = w.visible_keys(0, 10)
    assert mask[7].nonzero().flatten().tolist() == [0, 2, 3, 4, 5, 6, 7]  # block 3 starts at 6: keys 2..7
    assert mask[6].nonzero().flatten().tolist() == [0, 2, 3, 4, 5, 6]
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    assert torch.equal(mask[: w.exact_tokens], causal[: w.exact_tokens])  # rows 0..5 see every earlier key
    assert torch.equal(w.visible_keys(7, 3), mask[7:])


@pytest.mark.parametrize("window", [SMALL, ScoringWindow(window=16, block=16, sink=0),
                                    ScoringWindow(window=0, block=8, sink=3)], ids=["w32-b16-s4", "w16-no-sink", "w0"])
@pytest.mark.parametrize("start,rows", [(0, 150), (37, 50), (100, 1), (64, 16)])
def test_blockwise_attention_matches_the_masked_reference(window, start, rows):
    g = torch.Generator().manual_seed(start + rows)
    S = start + rows
    q = torch.randn(1, 4, rows, 16, generator=g)
    k, v = torch.randn(1, 2, S + 5, 16, generator=g), torch.randn(1, 2, S + 5, 16, generator=g)  # + unused rows
    got = window.attend(q, k, v, start, 0.25)
    torch.testing.assert_close(got, window.attend_reference(q, k, v, start, 0.25), rtol=1e-5, atol=1e-5)


def test_layer_loop_with_exact_attention_is_the_models_forward(tiny):
    ids = random_ids(90, seed=1)
    ours = prefilled(tiny, ids, exact_attention, chunk=40)
    theirs = ContiguousKVCache(tiny.config, len(ids), tiny.device, tiny.dtype)
    for begin in range(0, len(ids), 40):
        tiny(torch.tensor([ids[begin : begin + 40]]), theirs, last_only=True)
    assert ours.length == theirs.length == len(ids)
    assert_same_cache(ours, theirs, exact=True)


@pytest.mark.parametrize("chunk", [200, 23])
def test_windowed_prefill_attends_to_exactly_the_window(tiny, chunk):
    """Blockwise SDPA == one dense masked attention per layer, however the rows are chunked."""
    ids = random_ids(200, seed=2)
    assert_same_cache(prefilled(tiny, ids, SMALL.attend, chunk), prefilled(tiny, ids, SMALL.attend_reference, 200))


def test_scores_below_the_window_are_exact(tiny):
    ids = random_ids(SMALL.exact_tokens, seed=3)
    assert not SMALL.applies(len(ids))
    exact = score_prompt(tiny, ids, prefill_chunk=20, window=None)
    assert torch.equal(score_prompt(tiny, ids, prefill_chunk=20, window=SMALL), exact)


def test_scores_above_the_window_are_the_masked_references(tiny):
    ids = random_ids(200, seed=4)
    assert SMALL.applies(len(ids))
    got = score_prompt(tiny, ids, prefill_chunk=64, window=SMALL)
    cache = prefilled(tiny, ids[:-8], SMALL.attend_reference, 192, max_len=len(ids))
    expected = score_tail(tiny, torch.tensor([ids[-8:]]), cache)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    exact = score_prompt(tiny, ids, prefill_chunk=64, window=None)
    assert not torch.allclose(got, exact, rtol=1e-3, atol=1e-6)  # the window did change something


@pytest.mark.parametrize("bad", [dict(window=30, block=16), dict(block=0), dict(sink=-1)])
def test_bad_windows_are_refused(bad):
    with pytest.raises(ValueError):
        ScoringWindow(**bad)


def test_the_compressor_scores_long_prompts_windowed_and_says_so(tmp_path):
    from batchd.engine.pflash import PromptCompressor
    from batchd.engine.runtime import Engine, EngineConfig
    from batchd.engine.types import CompressionOptions, Telemetry
    from tests.engine.test_pflash_helpers import llama3_tokenizer_json, tiny_drafter

    engine = Engine.load(str(tiny_drafter(tmp_path / "tiny", llama3_tokenizer_json())), EngineConfig(max_context=1024))
    ids = random_ids(600, seed=5, vocab=engine.config.vocab_size - 300)  # no special tokens
    options = CompressionOptions(mode="always", keep_ratio=0.5)
    notes = {}
    for window in (SMALL, ScoringWindow(window=1024, block=512)):
        telemetry = Telemetry()
        compressor = PromptCompressor(scoring_window=window)
        compressor.compress(engine, ids, options, telemetry)
        notes[window.window] = (compressor.last_report.windowed_scoring, telemetry.notes)
    assert notes[32][0] and any("windowed prefill (window 32 + sink 4 keys" in n for n in notes[32][1])
    assert not notes[1024][0] and not any("windowed" in n for n in notes[1024][1])  # 600 < 1536: exact


def test_fingerprint_tells_how_long_prompts_were_scored():
    from batchd.engine.pflash import PromptCompressor, ScoringWindow
    from batchd.engine.runtime import Engine, EngineConfig
    from batchd.engine.types import CompressionOptions, GenerationRequest
    from tests.engine.tiny_models import hf_model, ours_from_hf

    engine = Engine(ours_from_hf(hf_model("llama")), None, EngineConfig(max_context=256), eos_ids=set())
    compressed = GenerationRequest(compression=CompressionOptions(mode="auto"))
    assert engine.fingerprint(GenerationRequest())["scoring_window"] is None       # no compression
    assert engine.fingerprint(compressed)["scoring_window"] == "w8192-b4096-s128"  # the default
    engine.compressor = PromptCompressor(scoring_window=ScoringWindow(window=4096, block=2048, sink=64))
    assert engine.fingerprint(compressed)["scoring_window"] == "w4096-b2048-s64"
    engine.compressor = PromptCompressor(scoring_window=None)
    assert engine.fingerprint(compressed)["scoring_window"] == "exact"
