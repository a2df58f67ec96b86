"""CUDA-only: the batch engine's invariance in bf16 at real model shapes (random weights), batch 1
to 64. Skipped where there is no GPU (CI); run on the device machine."""
from __future__ import annotations

import random

import pytest
import torch

from batchd.engine.batch import BatchOptions
from batchd.engine.presets import preset
from batchd.engine.runtime import Engine, EngineConfig, build_model
from batchd.engine.types import GenerationRequest, SamplingParams, SpeculationOptions

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run(engine: Engine, prompts, news, *, spec: str = "none", order=None) -> dict[int, list[int]]:
    batch = engine.batch_engine()
    order = order or list(range(len(prompts)))
    seqs = {i: batch.submit(prompts[i], GenerationRequest(
        sampling=SamplingParams(max_new_tokens=news[i], ignore_eos=True), speculation=SpeculationOptions(method=spec)))
        for i in order}
    while batch.has_work:
        batch.step()
    return {i: s.generated for i, s in seqs.items()}


@pytest.fixture(scope="module", params=["qwen2.5-1.5b", "llama-3-8b"])
def engine(request):
    config = preset(request.param)
    model = build_model(config, "cuda", torch.bfloat16, seed=3)
    engine = Engine(model, None, EngineConfig(max_context=4096, prefill_chunk=256), eos_ids=set())
    engine.batch_engine(BatchOptions(block_size=64, max_step_tokens=1024))
    yield engine
    engine.close()


def workload(vocab: int, n: int, seed: int = 0):
    rng = random.Random(seed)
    # a shared 512-token head on half of them: prefix chunks are shared by hash
    head = [rng.randrange(vocab) for _ in range(512)]
    prompts = [(head if i % 2 else []) + [rng.randrange(vocab) for _ in range(rng.randrange(20, 900))] for i in range(n)]
    return prompts, [rng.randrange(8, 40) for _ in range(n)]


def test_ids_alone_equal_ids_in_batches_of_8_and_64(engine):
    prompts, news = workload(engine.config.vocab_size, 64)
    together = run(engine, prompts, news)
    reversed_8 = run(engine, prompts[:8], news[:8], order=list(range(7, -1, -1)))
    for i in (0, 1, 5, 7, 33, 63):
        alone = run(engine, [prompts[i]], [news[i]])[0]
        assert alone == together[i], i
        if i < 8:
            assert alone == reversed_8[i], i


def test_lookup_speculation_changes_no_id(engine):
    prompts, news = workload(engine.config.vocab_size, 16, seed=1)
    prompts = [p + p[-64:] for p in prompts]   # repeats: lookup finds drafts
    assert run(engine, prompts, news, spec="lookup") == run(engine, prompts, news)


def test_a_small_pool_preempts_and_changes_no_id(engine):
    prompts, news = workload(engine.config.vocab_size, 12, seed=2)
    want = run(engine, prompts, news)
    small = Engine(engine.model, None, EngineConfig(max_context=4096, prefill_chunk=256), eos_ids=set())
    batch = small.batch_engine(BatchOptions(block_size=64, max_step_tokens=1024, max_blocks=40))
    got = run(small, prompts, news)
    assert got == want
    assert batch.cache.blocks.num_free == 40


def test_steps_launched_ahead_change_no_id(engine):
    """Decode steps launched before the last one is read back (pinned copies, an event, inputs
    gathered on the device) against steps read back one by one: same ids, a seeded sampled job's
    draws included, in a pool small enough to preempt."""
    prompts, news = workload(engine.config.vocab_size, 24, seed=4)

    def run_with(launch_ahead: bool):
        other = Engine(engine.model, None, EngineConfig(max_context=4096, prefill_chunk=256), eos_ids=set())
        batch = other.batch_engine(BatchOptions(block_size=64, max_step_tokens=1024, max_blocks=300,
                                                launch_ahead=launch_ahead))
        seqs = [batch.submit(p, GenerationRequest(sampling=SamplingParams(
            max_new_tokens=n, ignore_eos=True, temperature=0.9 if i == 3 else 0.0, seed=11 if i == 3 else None)))
            for i, (p, n) in enumerate(zip(prompts, news))]
        while batch.has_work:
            batch.step()
        assert (batch.steps_ahead > 0) == launch_ahead and batch.cache.blocks.num_free == 300
        other.close()
        return [s.generated for s in seqs]

    assert run_with(True) == run_with(False)
