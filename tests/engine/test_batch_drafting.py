"""Draft-model speculation inside the batch engine, on a tiny random model (CPU).

A drafter gets a paged pool of its own addressed by the target's block tables. These tests pin
what that must give: greedy ids equal to plain decoding alone whatever the drafter, the width and
the neighbours; a target drafting for itself holds the target's very rows in its pool (so every
draft is accepted) through prompt chunks, shared prompt heads and preemption; two drafters and
prompt lookup in one batch; a sampled job drafting with its seed; a job whose drafter cannot draft
fails alone. (SmolLM2's real weights: tests/engine/test_batch.py.)
"""
from __future__ import annotations

import pytest
import torch

from batchd.engine.batch import BatchOptions
from batchd.engine.errors import BadInputError
from batchd.engine.runtime import Engine, EngineConfig
from batchd.engine.speculative import self_drafter, truncated_drafter
from batchd.engine.types import GenerationRequest, SamplingParams, SpeculationOptions
from batchd.kernels.paged_attention.reference import gather_rows
from tests.engine.tiny_models import hf_model, ours_from_hf

pytest.importorskip("transformers")

LENGTHS = [5, 19, 37, 64, 90]   # around the prefill chunk (16) and past MAX_TAIL_ROWS
NEW_TOKENS = [20, 31, 9, 26, 17]


def tiny_target() -> Engine:
    engine = Engine(ours_from_hf(hf_model("llama")), None, EngineConfig(max_context=256), eos_ids=set())
    engine.drafters.register("self", self_drafter(engine.drafters.target))
    engine.drafters.register("first-layer", truncated_drafter(engine.drafters.target, 1))
    return engine


def batch_of(engine: Engine, **options):
    return engine.batch_engine(BatchOptions(block_size=8, prefill_chunk=16, max_step_tokens=32, **options))


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    out = [torch.randint(0, 512, (n,), generator=g).tolist() for n in LENGTHS]
    out[3] = out[3][:32] + out[3][:32]   # a repeat, where prompt lookup finds something
    return out


def request(i: int, spec: SpeculationOptions = SpeculationOptions(), **sampling) -> GenerationRequest:
    return GenerationRequest(sampling=SamplingParams(max_new_tokens=NEW_TOKENS[i], **sampling), speculation=spec)


def run(batch, jobs, after_step=None):
    """jobs: (prompt ids, request) -> (generated ids per job, their sequences)."""
    seqs = [batch.submit(prompt, req) for prompt, req in jobs]
    while batch.has_work:
        batch.step()
        if after_step is not None:
            after_step(batch)
    assert all(s.finish_reason == "length" for s in seqs)
    return [s.generated for s in seqs], seqs


def draft(drafter: str, width: int | None) -> SpeculationOptions:
    return SpeculationOptions("draft", drafter_path=drafter, width=width)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return tiny_target()


@pytest.fixture(scope="module")
def alone(engine) -> list[list[int]]:
    """Each job alone, speculation off: the reference ids."""
    return [run(batch_of(engine), [(p, request(i))])[0][0] for i, p in enumerate(prompts())]


def assert_pool_holds_the_targets_rows(batch) -> None:
    """Every position a self-drafter has of a running sequence equals the target's row, bit for bit."""
    for seq in batch.scheduler.running:
        state = batch._draft_states.get(seq.seq_id)
        if state is None:
            continue
        state.sync(seq)   # what the engine does first with a sequence preempted since its last look
        table = torch.tensor(seq.blocks, dtype=torch.int32)
        target, drafter = batch.cache, state.drafter.cache
        for layer in range(len(target.keys)):
            for mine, theirs in ((target.keys, drafter.keys), (target.values, drafter.values)):
                assert torch.equal(gather_rows(mine[layer], table, state.computed),
                                   gather_rows(theirs[layer], table, state.computed)), (seq.seq_id, layer)


@pytest.mark.parametrize("width", [1, 3, 16, None], ids=lambda w: f"w{w}" if w else "adaptive")
@pytest.mark.parametrize("drafter", ["first-layer", "self"])
def test_greedy_ids_with_a_draft_model_equal_plain_decoding_alone(engine, alone, drafter, width):
    ids, seqs = run(batch_of(engine), [(p, request(i, draft(drafter, width))) for i, p in enumerate(prompts())])
    assert ids == alone
    if width is not None:
        assert all(s.spec_offered > 0 for s in seqs)


def test_a_target_drafting_for_itself_holds_its_rows_and_is_always_accepted(engine, alone):
    checked = {"steps": 0}

    def check(batch):
        assert_pool_holds_the_targets_rows(batch)
        checked["steps"] += 1

    ids, seqs = run(batch_of(engine), [(p, request(i, draft("self", 4))) for i, p in enumerate(prompts())], check)
    assert ids == alone and checked["steps"] > 0
    for seq in seqs:
        assert seq.spec_accepted == seq.spec_offered > 0, seq.seq_id
        assert seq.spec_accepted_at == seq.spec_offered_at


def test_two_drafters_and_prompt_lookup_in_one_batch(engine, alone):
    specs = [SpeculationOptions(), SpeculationOptions("lookup", width=4), draft("self", 5), draft("first-layer", 3),
             draft("self", 2)]
    batch = batch_of(engine)
    ids, seqs = run(batch, [(p, request(i, specs[i])) for i, p in enumerate(prompts())])
    assert ids == alone
    assert sorted(batch._pooled) == ["first-layer", "self"]
    for i in (2, 4):
        assert seqs[i].spec_accepted == seqs[i].spec_offered > 0
    assert seqs[3].spec_offered > 0 and seqs[0].spec_offered == 0


def test_preemption_drops_the_drafters_rows_and_changes_no_id(alone):
    engine = tiny_target()
    batch = batch_of(engine, max_blocks=20)   # 160 positions for jobs that need 441 together
    ids, seqs = run(batch, [(p, request(i, draft("self", 4))) for i, p in enumerate(prompts())],
                    assert_pool_holds_the_targets_rows)
    assert ids == alone
    assert batch.scheduler.preemptions > 0
    assert all(s.spec_accepted == s.spec_offered > 0 for s in seqs)
    assert batch.cache.blocks.num_free == 20


def test_a_shared_prompt_head_is_computed_once_by_the_drafter_too(engine):
    head = prompts()[4][:48]   # three whole chunks, shared by hash
    jobs = [(head + tail, request(i)) for i, tail in enumerate(([1, 2, 3], [4, 5, 6, 7], [8], [9, 10]))]
    reference = [run(batch_of(engine), [job])[0][0] for job in jobs]
    batch = batch_of(engine)
    jobs = [(p, request(i, draft("self", 4))) for i, (p, _) in enumerate(jobs)]
    ids, seqs = run(batch, jobs, assert_pool_holds_the_targets_rows)
    assert ids == reference
    shared = sum(s.shared_chunks for s in seqs) * 16
    assert shared > 0 and all(s.spec_accepted == s.spec_offered > 0 for s in seqs)
    # what the target took from the prefix cache, the drafter did not compute again either
    assert batch._pooled["self"].prompt_positions == sum(len(p) for p, _ in jobs) - shared


def test_a_seeded_sampling_job_drafts_with_its_own_distribution(engine):
    """Rejection sampling gets the drafter's distributions (engine.speculative.verify): the job
    drafts, its ids are the seed's (two runs agree, another seed differs) and in the vocabulary."""
    def sampled(seed: int) -> tuple[list[int], object]:
        job = (prompts()[1], request(1, draft("first-layer", 3), temperature=0.9, seed=seed))
        ids, [seq] = run(batch_of(engine), [job])
        return ids[0], seq

    (first, seq), (again, _), (other, _) = sampled(5), sampled(5), sampled(6)
    assert first == again and first != other
    assert seq.spec_offered > 0 and all(0 <= t < 512 for t in first)


def test_a_job_whose_drafter_cannot_draft_fails_alone(engine, alone):
    """(A drafter of another vocabulary is refused by the registry: tests/engine/test_spec_edges.py.)"""
    batch = batch_of(engine)
    refusals = [(SpeculationOptions("draft"), "needs --drafter"),
                (draft("/nonexistent/drafter.gguf", None), "does not exist"),
                (draft("self", 17), "--spec-width")]
    for spec, message in refusals:
        with pytest.raises(BadInputError, match=message):
            batch.submit(prompts()[0], request(0, spec))
    ids, _ = run(batch, [(prompts()[0], request(0, draft("self", 2)))])
    assert ids == alone[:1]
    assert not batch.has_work and batch.cache.blocks.num_free == batch.cache.blocks.num_blocks
