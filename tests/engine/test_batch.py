"""The batch engine on SmolLM2's real weights (CPU): a job's tokens do not depend on what runs
beside it, in what order it arrived, on speculation (prompt lookup, draft models), on preemption,
or on a cancelled neighbour."""
from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest

from batchd.engine.batch import BatchOptions
from batchd.engine.batch.scheduler import Scheduler
from batchd.engine.errors import BadInputError, PromptTooLongError
from batchd.engine.runtime import Engine, EngineConfig
from batchd.engine.types import GenerationRequest, SamplingParams, SpeculationOptions

pytestmark = pytest.mark.slow

TOPICS = ["the moon", "tea", "rivers", "prime numbers", "owls", "glass", "winter", "maps"]


@pytest.fixture(scope="module")
def engine(smollm2_gguf) -> Engine:
    engine = Engine.load(str(smollm2_gguf), EngineConfig(max_context=1024, prefill_chunk=64))
    engine.batch_engine(BatchOptions(block_size=16, max_step_tokens=128))
    return engine


def requests(spec: str = "none") -> list[GenerationRequest]:
    """8 jobs of different lengths and parameters; job 5 samples with a seed, job 6 has a stop string."""
    rng = random.Random(0)
    out = []
    for i, topic in enumerate(TOPICS):
        prompt = f"Write about {topic}. " + " ".join(f"Fact {k}: {topic} matter." for k in range(rng.randrange(1, 30)))
        sampling = SamplingParams(max_new_tokens=6 + 2 * i, temperature=0.8 if i == 5 else 0.0, seed=7 if i == 5 else None,
                                  stop=("\n",) if i == 6 else (), ignore_eos=i == 3)
        out.append(GenerationRequest(prompt=prompt, chat=i % 2 == 0, sampling=sampling,
                                     speculation=SpeculationOptions(method=spec)))
    return out


def run(engine: Engine, reqs, order=None, **kwargs) -> dict[int, list[int]]:
    order = order or list(range(len(reqs)))
    got = {order[i]: r.token_ids for i, r in engine.generate_many([reqs[j] for j in order], **kwargs)}
    assert len(got) == len(order)
    return got


@pytest.fixture(scope="module")
def alone(engine) -> dict[int, list[int]]:
    reqs = requests()
    return {i: run(engine, [reqs[i]])[0] for i in range(len(reqs))}


@pytest.mark.parametrize("order", [list(range(8)), list(range(7, -1, -1)), [3, 6, 0, 5, 2, 7, 1, 4]],
                         ids=["in-order", "reversed", "shuffled"])
def test_ids_alone_equal_ids_in_a_batch_in_any_order(engine, alone, order):
    assert run(engine, requests(), order) == alone


def test_prompt_lookup_verified_in_the_batch_changes_no_greedy_id(engine, alone):
    """Job 5 samples: rejection sampling keeps its distribution, not its draws."""
    results = dict(engine.generate_many(requests("lookup")))
    got = {i: r.token_ids for i, r in results.items()}
    assert {i: ids for i, ids in got.items() if i != 5} == {i: ids for i, ids in alone.items() if i != 5}
    assert sum(r.telemetry.spec_draft_tokens_accepted for r in results.values()) > 0   # it did speculate


def with_drafters(engine: Engine, reqs: list[GenerationRequest]) -> list[GenerationRequest]:
    """Two drafters in one batch: SmolLM2 drafting for itself (even jobs) and its first 6 layers
    with the final norm and head (odd jobs, a poor drafter: most drafts are rejected)."""
    itself, first_layers = engine.checkpoint_path, engine.checkpoint_path + "#layers=6"
    return [replace(r, speculation=SpeculationOptions("draft", drafter_path=first_layers if i % 2 else itself,
                                                      width=3 if i % 2 else 4)) for i, r in enumerate(reqs)]


def test_draft_models_verified_in_the_batch_change_no_greedy_id(engine, alone):
    """Job 5 samples (with the first layers' distributions); SmolLM2 drafting for itself in the
    batch holds the target's very rows, so each of its drafts is accepted."""
    results = dict(engine.generate_many(with_drafters(engine, requests())))
    got = {i: r.token_ids for i, r in results.items()}
    assert {i: ids for i, ids in got.items() if i != 5} == {i: ids for i, ids in alone.items() if i != 5}
    for i, result in results.items():
        t = result.telemetry
        assert t.spec_method == "draft" and t.spec_draft_tokens_offered > 0, i
        if i % 2 == 0:
            assert t.acceptance_rate == 1.0 and set(t.acceptance_per_position) == {1.0}, i
    assert results[1].fingerprint["drafter_sha256"] == engine.checkpoint_sha256   # the GGUF's, layers cut


def test_generate_runs_a_draft_job_as_a_batch_of_one(engine, alone):
    """`Engine.generate` and `generate_many` give a job the same ids and SHA, drafter or not."""
    request = with_drafters(engine, requests())[1]
    result = engine.generate(request)
    assert result.token_ids == alone[1]
    assert result.fingerprint["batched"] and result.telemetry.spec_draft_tokens_offered > 0
    assert not any("one-sequence" in note for note in result.telemetry.notes)


def test_a_pool_too_small_for_all_preempts_and_changes_no_id(smollm2_gguf, alone):
    small = Engine.load(str(smollm2_gguf), EngineConfig(max_context=1024, prefill_chunk=64))
    batch = small.batch_engine(BatchOptions(block_size=16, max_step_tokens=128, max_blocks=26))
    assert run(small, requests()) == alone
    assert batch.scheduler.preemptions > 0
    assert batch.cache.blocks.num_free == 26


def test_a_pool_too_small_for_all_preempts_drafters_too_and_changes_no_id(smollm2_gguf, alone):
    # Admission reserves a prompt's blocks whole, so only decode growth preempts: with these
    # short jobs that needs a pool sized to the step plan (26 blocks: 5 preemptions, deterministic)
    small = Engine.load(str(smollm2_gguf), EngineConfig(max_context=1024, prefill_chunk=64))
    batch = small.batch_engine(BatchOptions(block_size=16, max_step_tokens=128, max_blocks=26))
    results = dict(small.generate_many(with_drafters(small, requests())))
    assert {i: r.token_ids for i, r in results.items() if i != 5} == {i: ids for i, ids in alone.items() if i != 5}
    assert batch.scheduler.preemptions > 0
    assert all(results[i].telemetry.acceptance_rate == 1.0 for i in (0, 2, 4, 6))


def test_a_cancelled_job_frees_its_blocks_and_the_others_do_not_change(engine, alone):
    batch = engine.batch_engine()
    steps = {"n": 0}

    def cancel_job_two(index: int) -> bool:
        steps["n"] += index == 0
        return index == 2 and steps["n"] >= 3

    got = run_partial(engine, requests(), cancel_job_two)
    assert 2 not in got
    assert {i: ids for i, ids in alone.items() if i != 2} == got
    assert batch.cache.blocks.num_free == batch.cache.blocks.num_blocks


def greedy(reqs: list[GenerationRequest]) -> list[GenerationRequest]:
    return [replace(r, sampling=replace(r.sampling, temperature=0.0, seed=None)) for r in reqs]


def stopping_requests() -> list[GenerationRequest]:
    """Greedy jobs that end early: by EOS (8 and 30 tokens), at a stop string, by length."""
    return [GenerationRequest(prompt="Answer with one word: what colour is the sky?", chat=True,
                              sampling=SamplingParams(max_new_tokens=30)),
            GenerationRequest(prompt="Write about owls.", chat=True, sampling=SamplingParams(max_new_tokens=30, stop=(".",))),
            GenerationRequest(prompt="Write about tea.", sampling=SamplingParams(max_new_tokens=30, stop=(",",))),
            GenerationRequest(prompt="Reply with yes or no: is water wet?", chat=True,
                              sampling=SamplingParams(max_new_tokens=30))]


def test_decode_steps_launched_ahead_change_no_id_stop_or_preemption(smollm2_gguf, monkeypatch):
    """Decode steps are launched before the last one is read back, so a job learns that it
    stopped one step late: ids, finish reasons and texts equal those of steps read back one by
    one, for greedy jobs and a seeded sampled one, with EOS, a stop string and length stops, in a pool small enough that a sequence is
    preempted while its token is still in flight; every block is free at the end."""
    small = Engine.load(str(smollm2_gguf), EngineConfig(max_context=1024, prefill_chunk=64))
    preempted_in_flight = []
    original = Scheduler.preempt
    monkeypatch.setattr(Scheduler, "preempt", lambda self, seq: (preempted_in_flight.append(seq.pending),
                                                                  original(self, seq)))
    outcomes = {}
    for ahead in (False, True):
        batch = small.batch_engine(BatchOptions(block_size=16, max_step_tokens=128, max_blocks=26, launch_ahead=ahead))
        jobs = requests() + stopping_requests()   # job 5 samples with a seed
        outcomes[ahead] = {i: (r.token_ids, r.finish_reason, r.text) for i, r in small.generate_many(jobs)}
        assert (batch.steps_ahead > 0) == ahead and batch.scheduler.preemptions > 0
        assert batch.cache.blocks.num_free == 26 and batch.in_flight is None
    assert outcomes[True] == outcomes[False]
    assert {reason for _, reason, _ in outcomes[True].values()} == {"eos", "stop", "length"}
    assert any(preempted_in_flight)


def test_a_job_cancelled_while_its_step_is_in_flight_leaves_the_others_unchanged(engine, alone):
    batch = engine.batch_engine()
    reqs = greedy(requests())
    reference = run(engine, reqs)
    cancelled_at = {}

    def cancel_job_four(index: int) -> bool:
        if index == 4 and not cancelled_at and batch.in_flight is not None and batch.steps_ahead >= 3:
            cancelled_at["step"] = batch.steps
        return index == 4 and bool(cancelled_at)

    got = run_partial(engine, reqs, cancel_job_four)
    assert cancelled_at and 4 not in got
    assert got == {i: ids for i, ids in reference.items() if i != 4}
    assert batch.cache.blocks.num_free == batch.cache.blocks.num_blocks


def run_partial(engine, reqs, cancelled):
    return {i: r.token_ids for i, r in engine.generate_many(reqs, cancelled=cancelled)}


def test_a_shared_prompt_head_is_computed_once(engine):
    head = "You summarise documents. " * 12   # a batch-wide instruction, several chunks long
    reqs = [GenerationRequest(prompt=head + f"Document {i}: {TOPICS[i]} are interesting.",
                              sampling=SamplingParams(max_new_tokens=6)) for i in range(3)]
    alone_ids = [run(engine, [r])[0] for r in reqs]
    batch = engine.batch_engine()
    seqs = []
    original = batch.submit

    def submit(prompt_ids, request, *args, **kwargs):
        seqs.append(original(prompt_ids, request, *args, **kwargs))
        return seqs[-1]

    batch.submit = submit
    try:
        assert list(run(engine, reqs).values()) == alone_ids
    finally:
        del batch.submit
    assert any(s.shared_chunks > 0 for s in seqs)


def test_a_request_that_cannot_run_fails_alone(engine, alone):
    reqs = requests()
    too_long = GenerationRequest(prompt="word " * 2000, sampling=SamplingParams(max_new_tokens=8))
    outcomes = dict(engine.generate_many([reqs[0], too_long, reqs[1]]))
    assert isinstance(outcomes[1], PromptTooLongError)
    assert outcomes[0].token_ids == alone[0] and outcomes[2].token_ids == alone[1]
    no_drafter = replace(reqs[0], speculation=SpeculationOptions("draft", drafter_path="/nonexistent/drafter.gguf"))
    outcomes = dict(engine.generate_many([no_drafter, reqs[1]]))
    assert isinstance(outcomes[0], BadInputError) and "does not exist" in outcomes[0].message
    assert outcomes[1].token_ids == alone[1]


def test_greedy_ids_are_those_of_the_one_sequence_engine(engine, alone):
    """The batch path (prompt chunks over the paged pool, decode rows in slabs) computes the same
    model as the one-sequence path: on these float32 jobs every greedy token agrees."""
    reqs = requests()
    for i, request in enumerate(reqs):
        if request.sampling.temperature == 0:
            assert engine.generate_one(request).token_ids == alone[i], i


def test_prefill_seconds_cover_the_prompt_computation(engine, monkeypatch):
    """prefill_s runs from the first step that scheduled the job to its first token: a prompt
    that takes at least 0.2 s to compute shows at least 0.2 s (it once read 0.00 s)."""
    batch = engine.batch_engine()
    original = batch._prefill_first_chunk

    def slow_prefill(chunk):
        time.sleep(0.2)
        return original(chunk)

    monkeypatch.setattr(batch, "_prefill_first_chunk", slow_prefill)
    # a prompt no other test ran: a head already in the pool would be shared, not computed
    result = engine.generate(replace(requests()[1], prompt="Prefill timing. Name a colour."))
    assert result.telemetry.prefill_s >= 0.2
    assert result.telemetry.prefill_tokens_per_s <= result.prompt_tokens / 0.2


def test_packed_prompt_chunks_change_no_id_alone_batched_or_drafted(smollm2_gguf):
    """Prompt chunks in fixed 32-row slabs, first chunks packed with the rest (CUDA's default
    path, engine.batch.chunks.ChunkPacking): ids alone equal ids in a shuffled batch, and a
    drafter taking the same path holds the target's very rows (every draft accepted)."""
    packed = Engine.load(str(smollm2_gguf), EngineConfig(max_context=1024, prefill_chunk=64))
    batch = packed.batch_engine(BatchOptions(block_size=16, max_step_tokens=128, chunk_slab_rows=32))
    assert batch.packing.slab_rows == 32 and batch.packing.in_pass(0, 64)
    reqs = requests()
    alone_packed = {i: run(packed, [reqs[i]])[0] for i in range(len(reqs))}
    assert run(packed, reqs, [3, 6, 0, 5, 2, 7, 1, 4]) == alone_packed
    results = dict(packed.generate_many(with_drafters(packed, reqs)))
    assert {i: r.token_ids for i, r in results.items() if i != 5} == {i: ids for i, ids in alone_packed.items() if i != 5}
    assert all(results[i].telemetry.acceptance_rate == 1.0 for i in (0, 2, 4, 6))
