"""Generation loop properties on tiny random checkpoints (token-id core, no tokenizer)."""
from __future__ import annotations

import pytest
import torch

from batchd.engine.errors import BadInputError, PromptTooLongError
from batchd.engine.runtime import Engine, EngineConfig
from batchd.engine.generate import TokenOutput
from batchd.engine.types import GenerationRequest, SamplingParams, Telemetry
from tests.engine.tiny_models import ARCHITECTURES, hf_model, ours_from_hf

pytest.importorskip("transformers")


def tiny_engine(name: str, max_context: int = 128, eos_ids=frozenset()) -> tuple[object, Engine]:
    hf = hf_model(name)
    return hf, Engine(ours_from_hf(hf), None, EngineConfig(max_context=max_context), eos_ids=set(eos_ids))


def run(engine: Engine, prompt: list[int], **sampling):
    return engine.generate_ids(prompt, GenerationRequest(sampling=SamplingParams(**sampling)))


PROMPT = [5, 17, 301, 42, 7, 99, 256, 3, 11]


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_greedy_matches_transformers_token_for_token(name):
    hf, engine = tiny_engine(name)
    out = run(engine, PROMPT, max_new_tokens=24, ignore_eos=True)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert out.token_ids == expected
    assert out.finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    _, engine = tiny_engine("llama")
    a = run(engine, PROMPT, max_new_tokens=32, temperature=1.0, seed=7).token_ids
    b = run(engine, PROMPT, max_new_tokens=32, temperature=1.0, seed=7).token_ids
    c = run(engine, PROMPT, max_new_tokens=32, temperature=1.0, seed=8).token_ids
    assert a == b
    assert a != c


def test_top_k_one_is_greedy():
    _, engine = tiny_engine("qwen2")
    greedy = run(engine, PROMPT, max_new_tokens=16).token_ids
    top1 = run(engine, PROMPT, max_new_tokens=16, temperature=0.7, top_k=1, seed=3).token_ids
    assert top1 == greedy


def test_tiny_top_p_is_greedy():
    _, engine = tiny_engine("qwen3")
    greedy = run(engine, PROMPT, max_new_tokens=16).token_ids
    nucleus = run(engine, PROMPT, max_new_tokens=16, temperature=1.0, top_p=1e-6, seed=3).token_ids
    assert nucleus == greedy


def test_eos_ends_generation_without_emitting_it():
    _, probe = tiny_engine("llama")
    greedy = run(probe, PROMPT, max_new_tokens=12).token_ids
    eos = greedy[5]
    _, engine = tiny_engine("llama", eos_ids={eos})
    out = run(engine, PROMPT, max_new_tokens=12)
    assert out.finish_reason == "eos"
    assert out.token_ids == greedy[: greedy.index(eos)]


def test_max_new_tokens_respected():
    _, engine = tiny_engine("llama")
    for n in (1, 2, 17):
        assert len(run(engine, PROMPT, max_new_tokens=n, ignore_eos=True).token_ids) == n


def test_decode_rate_counts_the_tokens_the_decode_steps_made():
    """The first token is sampled from the prefill's logits (time to first token): a decode phase
    of d seconds after n tokens made n - 1 of them, and a one-token answer has no rate."""
    assert TokenOutput([5, 6, 7, 8, 9], "length", prefill_s=1.0, decode_s=2.0).decode_tokens_per_s == 2.0
    assert TokenOutput([5], "length", prefill_s=1.0, decode_s=1e-4).decode_tokens_per_s == 0.0
    assert TokenOutput([], "eos", prefill_s=1.0, decode_s=0.0).decode_tokens_per_s == 0.0
    _, engine = tiny_engine("llama")
    request = GenerationRequest(sampling=SamplingParams(max_new_tokens=1, ignore_eos=True))
    telemetry = Telemetry()
    engine.generate_ids(PROMPT, request, telemetry)
    assert telemetry.decode_tokens_per_s == 0.0 and telemetry.prefill_tokens_per_s > 0


def test_prompt_longer_than_context_is_refused_clearly():
    _, engine = tiny_engine("llama", max_context=32)
    with pytest.raises(PromptTooLongError, match="32-token context"):
        run(engine, list(range(30)), max_new_tokens=8)


@pytest.mark.parametrize("bad", [dict(max_new_tokens=-1), dict(temperature=-0.5), dict(top_p=0.0), dict(top_k=-2)])
def test_invalid_sampling_params_are_bad_input(bad):
    _, engine = tiny_engine("llama")
    with pytest.raises(BadInputError):
        run(engine, PROMPT, **bad)


def test_second_job_matches_fresh_engine():
    _, engine = tiny_engine("qwen2")
    run(engine, list(range(60)), max_new_tokens=20)
    second = run(engine, PROMPT, max_new_tokens=20).token_ids
    _, fresh = tiny_engine("qwen2")
    assert second == run(fresh, PROMPT, max_new_tokens=20).token_ids


@pytest.mark.parametrize("sync_every, read_lag", [(1, 0), (4, 2), (3, 5), (16, 2)])
def test_batched_late_read_back_keeps_ids_budget_and_stops(sync_every, read_lag):
    """The CUDA loop's read-back schedule (batches of sync_every ids, read read_lag steps late),
    forced on the CPU: the same ids, the budget to the token, EOS and the full cache in time."""
    from batchd.engine.generate import generate_plain
    from batchd.engine.sampling import Sampler
    from batchd.engine.stopping import StopChecker

    _, engine = tiny_engine("llama", max_context=len(PROMPT) + 20)

    def decode(max_new, eos=()):
        engine.cache.reset()
        sampling = SamplingParams(max_new_tokens=max_new)
        out = generate_plain(engine.runner, PROMPT, Sampler(sampling, engine.device), StopChecker(set(eos), max_new),
                             sync_every=sync_every, read_lag=read_lag)
        return out.token_ids, out.finish_reason

    reference = run(engine, PROMPT, max_new_tokens=20, ignore_eos=True).token_ids
    for n in (1, 2, 5, 17):
        assert decode(n) == (reference[:n], "length")
    eos = reference[6]
    assert decode(20, eos={eos}) == (reference[: reference.index(eos)], "eos")
    # the cache holds the prompt and 20 more rows, and the last token needs none: 21 tokens fit
    all_that_fit, reason = decode(40)
    assert (len(all_that_fit), reason) == (21, "length") and all_that_fit[:20] == reference
