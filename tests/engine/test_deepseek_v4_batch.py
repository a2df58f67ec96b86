"""DeepSeek V4 in the batch engine's scheduler and a paged pool (engine.deepseek_v4.paged, .batch):
a job's greedy output is the same alone (engine.deepseek_v4.generate_greedy, itself equal to
transformers' in test_deepseek_v4.py), batched with others, preempted and recomputed, sharing a
prompt prefix, and speculating with prompt lookup (with the MTP layer: test_deepseek_v4_mtp.py)."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("transformers without deepseek_v4 (needs >= 5.8)", allow_module_level=True)

from batchd.engine.deepseek_v4 import V4Config, build_model, generate_greedy  # noqa: E402
from batchd.engine.deepseek_v4.batch import V4BatchEngine  # noqa: E402
from batchd.engine.deepseek_v4.paged import PagedV4Pool  # noqa: E402
from batchd.engine.errors import UnsupportedFeatureError  # noqa: E402
from batchd.engine.types import GenerationRequest, SamplingParams, SpeculationOptions  # noqa: E402
from tests.engine.test_deepseek_v4 import reference_model  # noqa: E402

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def model():
    reference = reference_model()
    return build_model(V4Config.from_hf_dict(reference.config.to_dict()), tensors=dict(reference.state_dict()))


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def request(spec: str = "none", width=None) -> GenerationRequest:
    return GenerationRequest(sampling=SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
                             speculation=SpeculationOptions(method=spec, width=width))


def run(engine: V4BatchEngine, prompts: list[list[int]], spec: str = "none", width=None) -> list[list[int]]:
    seqs = [engine.submit(p, request(spec, width)) for p in prompts]
    while engine.has_work:
        engine.step()
    return [s.generated for s in seqs]


def test_one_pool_many_sequences_matches_each_alone_in_a_contiguous_cache(model):
    """The paged layout itself: two sequences interleaved chunk by chunk in one pool."""
    pool = PagedV4Pool(model.config, num_blocks=16, block_size=16, device="cpu", dtype=torch.float32)
    a, b = torch.tensor([ids(70, 1)]), torch.tensor([ids(50, 2)])
    view_a, view_b = pool.view(pool.blocks.allocate(5), 0), pool.view(pool.blocks.allocate(4), 0)
    model(a[:, :32], view_a), model(b[:, :32], view_b)
    paged_a, paged_b = model(a[:, 32:], view_a), model(b[:, 32:], view_b)
    alone_a, alone_b = model(a, model.new_cache(80)), model(b, model.new_cache(80))
    assert torch.allclose(paged_a, alone_a[:, 32:], rtol=0, atol=1e-4)
    assert torch.allclose(paged_b, alone_b[:, 32:], rtol=0, atol=1e-4)


def test_batched_jobs_give_each_job_its_output_alone(model):
    prompts = [ids(70, 3), ids(45, 4), ids(90, 5)]
    engine = V4BatchEngine(model, max_context=128, eos_ids=set(), chunk=32)
    assert run(engine, prompts) == [generate_greedy(model, p, NEW_TOKENS) for p in prompts]


def test_more_decoding_jobs_than_a_row_step_run_in_shared_forwards(model, monkeypatch):
    """20 jobs decode in forwards of up to ROW_STEP (17) rows, not one forward a job, and each
    job's tokens are still its own alone."""
    prompts = [ids(20 + 3 * i, 40 + i) for i in range(20)]
    calls = []
    original = model.hidden_rows
    monkeypatch.setattr(model, "hidden_rows", lambda tokens, caches: (calls.append(len(caches)), original(tokens, caches))[1])
    engine = V4BatchEngine(model, max_context=128, eos_ids=set(), chunk=32, max_step_tokens=2048)
    assert run(engine, prompts) == [generate_greedy(model, p, NEW_TOKENS) for p in prompts]
    assert max(calls) == 17 and sum(calls) == 20 * (NEW_TOKENS - 1)


def test_preempted_jobs_recompute_to_the_same_output(model):
    """A pool too small for all three: the latest admitted is preempted and recomputed."""
    prompts = [ids(70, 6), ids(60, 7), ids(64, 8)]
    engine = V4BatchEngine(model, max_context=96, eos_ids=set(), chunk=32, num_blocks=13, max_step_tokens=96)
    assert run(engine, prompts) == [generate_greedy(model, p, NEW_TOKENS) for p in prompts]
    assert engine.scheduler.preemptions > 0


def test_a_shared_prompt_prefix_is_computed_once_and_changes_nothing(model):
    """Chunks of 32 hold whole windows of both compressors (4, 16): their blocks are shared."""
    prefix = ids(64, 9)
    prompts = [prefix + ids(10, 10), prefix + ids(20, 11)]
    engine = V4BatchEngine(model, max_context=128, eos_ids=set(), chunk=32)
    first = run(engine, prompts[:1])
    seq = engine.submit(prompts[1], request())
    while engine.has_work:
        engine.step()
    assert seq.shared_chunks == 2 and engine.notes == []
    assert [first[0], seq.generated] == [generate_greedy(model, p, NEW_TOKENS) for p in prompts]


def test_prefix_sharing_is_off_with_a_note_when_chunks_split_windows(model):
    engine = V4BatchEngine(model, max_context=128, eos_ids=set(), block_size=8, chunk=24)
    assert not engine.scheduler.prefix_sharing and "multiple of 16" in engine.notes[0]


def test_lookup_speculation_keeps_greedy_output_and_rolls_back_every_part(model):
    """Repetitive prompts make lookup propose; rejected drafts (windows closed inside them
    included) are rolled back by length alone."""
    phrase = ids(12, 12)
    prompts = [phrase * 6, (phrase[:5] + ids(3, 13)) * 8]
    engine = V4BatchEngine(model, max_context=128, eos_ids=set(), chunk=32)
    seqs = [engine.submit(p, request("lookup", width=4)) for p in prompts]
    while engine.has_work:
        engine.step()
    assert [s.generated for s in seqs] == [generate_greedy(model, p, NEW_TOKENS) for p in prompts]
    assert sum(s.spec_offered for s in seqs) > 0
    assert any(s.spec_accepted < s.spec_offered for s in seqs)   # something was rolled back


def test_draft_speculation_is_refused_without_an_mtp_layer(model):
    """(test_deepseek_v4_mtp.py drafts with one.)"""
    engine = V4BatchEngine(model, max_context=128, eos_ids=set())
    with pytest.raises(UnsupportedFeatureError, match="MTP layer"):
        engine.submit(ids(10, 14), request("draft"))


class RepeatingProposer:
    """Offers the last `width` tokens again: drafts on every step, some of them rejected."""

    def propose(self, context, width):
        from batchd.engine.speculative.proposers import Proposal

        return Proposal(torch.tensor(context[-width:]))


def sample(model, prompts_and_requests, proposer=None):
    engine = V4BatchEngine(model, max_context=128, eos_ids=set(), chunk=32)
    seqs = [engine.submit(p, r) for p, r in prompts_and_requests]
    if proposer is not None:
        engine._proposers = {seq.seq_id: proposer for seq in seqs}
    while engine.has_work:
        engine.step()
    return seqs


def test_a_seeded_sampled_job_is_the_same_alone_and_batched(model):
    """temperature > 0: each sequence draws from its own seeded generator, so its neighbours do not
    change its tokens."""
    sampled = GenerationRequest(sampling=SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.8, seed=7,
                                                        ignore_eos=True))
    prompt = ids(70, 15)
    [alone] = sample(model, [(prompt, sampled)])
    batched = sample(model, [(ids(50, 16), request()), (prompt, sampled), (ids(30, 17), sampled)])[1]
    assert batched.generated == alone.generated and len(alone.generated) == NEW_TOKENS


def test_sampled_drafts_go_through_rejection_sampling_and_roll_back(model):
    """Drafts on every step under temperature > 0: verified by rejection sampling (one-hot drafts),
    the rejected ones rolled back; the seeded result is reproducible and has its full length."""
    lookup = GenerationRequest(sampling=SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.8, seed=3,
                                                       ignore_eos=True),
                               speculation=SpeculationOptions(method="lookup", width=3))
    runs = [sample(model, [(ids(70, 18), lookup)], RepeatingProposer())[0] for _ in range(2)]
    assert runs[0].generated == runs[1].generated and len(runs[0].generated) == NEW_TOKENS
    assert runs[0].spec_offered > runs[0].spec_accepted


def test_the_pool_is_sized_by_the_bytes_a_block_really_takes(model):
    from batchd.engine.deepseek_v4.paged import bytes_per_block

    pool = PagedV4Pool.sized(model.config, 16, "cpu", torch.float32, max_blocks=7)
    assert pool.blocks.num_blocks == 7
    assert pool.nbytes == 8 * bytes_per_block(model.config, 16, torch.float32)   # 7 blocks and the spare
