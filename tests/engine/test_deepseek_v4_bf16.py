"""DeepSeek V4 in bf16: a row's bits do not depend on how many rows its step computes
(engine.deepseek_v4.rows), so greedy output is the same with speculation on or off and alone or
batched. The tiny checkpoint of test_deepseek_v4_mtp.py (every layer kind, random mtp.* tensors)
loaded in bf16; exact equality throughout, no tolerance. On a machine with CUDA every test runs
there too (kernels.small_matmul, the invariant MoE kernel, cuBLAS norms): the proof that lets
speculation run on CUDA in bf16/f16."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("transformers without deepseek_v4 (needs >= 5.8)", allow_module_level=True)

from batchd.engine.deepseek_v4 import generate_greedy, load_folder  # noqa: E402
from batchd.engine.deepseek_v4.batch import V4BatchEngine  # noqa: E402
from batchd.engine.deepseek_v4.config import CSA  # noqa: E402
from batchd.engine.deepseek_v4.mtp import MTPDrafter, build_mtp  # noqa: E402
from batchd.engine.sampling import Sampler  # noqa: E402
from batchd.engine.types import GenerationRequest, SamplingParams  # noqa: E402
from tests.engine.test_deepseek_v4_mtp import (NEW_TOKENS, assert_drafting_keeps_greedy_output, ids, request,  # noqa: E402
                                              run, write_v4_folder)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.fixture(scope="module", params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_v4_folder(tmp_path_factory.mktemp("v4-bf16"), with_mtp=True, kind=CSA)


@pytest.fixture(scope="module")
def loaded(folder, device):
    """(target, its MTP layer) in bf16; the MTP block is CSA, so its compressor and indexer run too."""
    model, aside = load_folder(folder, device=device, dtype=torch.bfloat16)
    return model, build_mtp(model, aside.mtp, "test")


def tokens_on(model, rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, device=model.device)


# (seed, prompt length, q): each of these verify steps rounded some row apart from its decode row
# before the row-invariant path (an nn.Linear or the grouped einsum at M = 1 against M = q), or
# without its per-row sigmoid (7, 70, 17 and 11, 90, 17: a vectorised kernel's scalar tail)
STEPS = [(3, 33, 9), (11, 70, 17), (12, 90, 17), (14, 70, 17), (7, 70, 17), (11, 90, 17), (1, 70, 2)]


@pytest.mark.parametrize("seed, prompt_len, q", STEPS)
def test_verify_rows_are_their_decode_rows_bit_for_bit(loaded, seed, prompt_len, q):
    """q rows at once after a prompt (closing CSA and HCA windows inside the step) give exactly
    the logits of the same q rows decoded one by one."""
    assert_verify_equals_decode(loaded[0], seed, prompt_len, q)


def test_f16_verify_rows_are_their_decode_rows_bit_for_bit(folder, device):
    model, _ = load_folder(folder, device=device, dtype=torch.float16)
    for seed, prompt_len, q in STEPS[:4]:
        assert_verify_equals_decode(model, seed, prompt_len, q)


def assert_verify_equals_decode(model, seed: int, prompt_len: int, q: int) -> None:
    prompt, following = ids(prompt_len, seed), ids(q, seed + 100)
    decoded = model.new_cache(128)
    model(tokens_on(model, [prompt]), decoded)
    one_by_one = torch.cat([model(tokens_on(model, [[t]]), decoded) for t in following], dim=1)
    verified = model.new_cache(128)
    model(tokens_on(model, [prompt]), verified)
    assert torch.equal(model(tokens_on(model, [following]), verified), one_by_one)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_rows_of_many_sequences_are_each_ones_decode_row_bit_for_bit(folder, device, dtype):
    """hidden_rows (one forward for the decode rows of 12 sequences, each at its own length)
    gives each row exactly its sequence's own one-row decode logits, step after step, through
    CSA and HCA windows that close in different steps for different sequences."""
    model, _ = load_folder(folder, device=device, dtype=dtype)
    prompts = [ids(n, seed) for seed, n in enumerate([33, 70, 90, 45, 64, 17, 81, 50, 38, 99, 60, 72])]
    together = [model.new_cache(128) for _ in prompts]
    alone = [model.new_cache(128) for _ in prompts]
    for p, a, b in zip(prompts, together, alone):
        model(tokens_on(model, [p]), a), model(tokens_on(model, [p]), b)
    for step in range(6):
        tokens = [ids(1, 200 + 10 * step + i)[0] for i in range(len(prompts))]
        rows = model.head(model.hidden_rows([[t] for t in tokens], together))[0]          # [B, V]
        for i, (token, cache) in enumerate(zip(tokens, alone)):
            assert torch.equal(rows[i], model(tokens_on(model, [[token]]), cache)[0, 0]), (step, i)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_verify_rows_of_several_sequences_are_each_ones_verify_rows_bit_for_bit(folder, device, dtype):
    """Ragged rows (3, 1, 5 and 8: 17 in all) of four sequences in one forward give each sequence
    exactly the logits of its own verify step."""
    model, _ = load_folder(folder, device=device, dtype=dtype)
    prompts, widths = [ids(33, 5), ids(70, 6), ids(90, 7), ids(45, 8)], [3, 1, 5, 8]
    together = [model.new_cache(128) for _ in prompts]
    alone = [model.new_cache(128) for _ in prompts]
    for p, a, b in zip(prompts, together, alone):
        model(tokens_on(model, [p]), a), model(tokens_on(model, [p]), b)
    rows = [ids(w, 300 + i) for i, w in enumerate(widths)]
    logits = model.head(model.hidden_rows(rows, together))[0]                                # [17, V]
    first = 0
    for tokens, cache in zip(rows, alone):
        assert torch.equal(logits[first : first + len(tokens)], model(tokens_on(model, [tokens]), cache)[0])
        first += len(tokens)


def test_mtp_drafting_keeps_greedy_output_alone_and_batched(loaded):
    model, mtp = loaded
    assert_drafting_keeps_greedy_output(model, mtp, [ids(40, 3), ids(23, 4), ids(57, 5)])


def test_oracle_drafts_accepted_in_part_keep_greedy_output(loaded, monkeypatch):
    """Drafts that are the target's own tokens (2 of 3 right) are accepted, so the accepted rows'
    logits came from verify steps and the next steps read the caches those rows wrote."""
    model, mtp = loaded
    prompt = ids(45, 6)
    expected = generate_greedy(model, prompt, NEW_TOKENS)
    engine = V4BatchEngine(model, max_context=128, eos_ids=set(), chunk=16, mtp=mtp)
    inner = engine.mtp.propose_many

    def oracle(requests):
        inner(requests)
        return [[*expected[len(tokens) - len(prompt) :][:2], 0][:width] for _, tokens, width, _ in requests]
    monkeypatch.setattr(engine.mtp, "propose_many", oracle)
    seq = run(engine, [(prompt, request("draft", 3))])[0]
    assert seq.generated == expected and 0 < seq.spec_accepted < seq.spec_offered


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_mtp_rows_of_many_sequences_are_each_ones_rows_alone(loaded, sampled):
    """The MTP's catch-up rows of several sequences (ragged: 3, 1, 5, 2 and 4 accepted rows) share
    one forward (observe_many), and their chained drafts share forwards too (propose_many); each
    sequence's guesses, drafts and (sampled) draft distributions are bit for bit those it makes
    alone, at widths 1 to 4, and each MTP cache is left at its context."""
    model, mtp = loaded
    drafter = MTPDrafter(model, mtp)
    lengths, accepted, widths = [33, 70, 45, 90, 58], [3, 1, 5, 2, 4], [4, 2, 1, 3, 4]
    alone_states, together_states, contexts, rows = [], [], [], []
    for seed, (length, extra) in enumerate(zip(lengths, accepted)):
        tokens = ids(length + extra + 1, 40 + seed)
        streams = model.hidden(tokens_on(model, [tokens[:-1]]), model.new_cache(128))[0]     # [length + extra, n, H]
        pair = [drafter.new_state(128), drafter.new_state(128)]
        for state in pair:
            drafter.observe(state, 0, streams[:length], tokens[: length + 1])    # the prompt: alone
        alone_states.append(pair[0]), together_states.append(pair[1]), contexts.append(tokens)
        rows.append((length, streams[length:]))
    for state, tokens, (length, streams) in zip(alone_states, contexts, rows):
        drafter.observe(state, length, streams, tokens)
    drafter.observe_many([(state, length, streams, tokens)
                          for state, tokens, (length, streams) in zip(together_states, contexts, rows)])
    for a, b in zip(alone_states, together_states):
        assert torch.equal(a.logits, b.logits) and torch.equal(a.streams, b.streams)

    def sampler(seed):
        return Sampler(SamplingParams(temperature=0.8, top_k=20, seed=seed), model.device) if sampled else None

    alone = [drafter.propose(state, tokens, width, sampler(i))
             for i, (state, tokens, width) in enumerate(zip(alone_states, contexts, widths))]
    together = drafter.propose_many([(state, tokens, width, sampler(i))
                                     for i, (state, tokens, width) in enumerate(zip(together_states, contexts, widths))])
    assert together == alone and [len(d) for d in alone] == widths
    for a, b, tokens in zip(alone_states, together_states, contexts):
        assert a.cache.length == b.cache.length == len(tokens) - 1
        assert (a.probs is None) == (b.probs is None) == (not sampled)
        if sampled:
            assert torch.equal(a.probs, b.probs)


class OracleLookup:
    """A lookup proposer that knows the greedy tokens: two right, then a wrong one, so every verify
    step accepts some rows and rolls one back."""

    def __init__(self, prompt_len: int, expected: list[int]):
        self.prompt_len, self.expected = prompt_len, expected

    def propose(self, context, width):
        from batchd.engine.speculative.proposers import Proposal

        done = len(context) - self.prompt_len
        return Proposal(torch.tensor([*self.expected[done : done + 2], 0][:width]))


def test_lookup_speculation_keeps_greedy_output(loaded):
    model, _ = loaded
    phrase = ids(12, 7)
    prompts = [phrase * 6, (phrase[:5] + ids(3, 8)) * 8, ids(50, 12)]
    expected = [generate_greedy(model, p, NEW_TOKENS) for p in prompts]
    engine = V4BatchEngine(model, max_context=128, eos_ids=set(), chunk=32)
    seqs = [engine.submit(p, request("lookup", 4)) for p in prompts]
    engine._proposers[seqs[2].seq_id] = OracleLookup(len(prompts[2]), expected[2])
    while engine.has_work:
        engine.step()
    assert [s.generated for s in seqs] == expected
    assert 0 < seqs[2].spec_accepted < seqs[2].spec_offered


def test_a_sequence_alone_and_batched_gives_the_same_tokens(loaded):
    model, _ = loaded
    prompts = [ids(70, 9), ids(45, 10), ids(90, 11)]
    alone = [run(V4BatchEngine(model, max_context=128, eos_ids=set(), chunk=32), [(p, request())])[0].generated
             for p in prompts]
    batched = run(V4BatchEngine(model, max_context=128, eos_ids=set(), chunk=32), [(p, request()) for p in prompts])
    assert [s.generated for s in batched] == alone == [generate_greedy(model, p, NEW_TOKENS) for p in prompts]


def test_preempted_jobs_recompute_to_the_same_tokens(loaded):
    """A pool too small for all three: the latest admitted is preempted, and its generated
    positions are recomputed (in pieces of up to 17 rows, so row by row as they were decoded)."""
    model, _ = loaded
    prompts = [ids(40, 24), ids(30, 25), ids(35, 26)]   # replayed as one piece, these rounded apart
    long = GenerationRequest(sampling=SamplingParams(max_new_tokens=40, ignore_eos=True))   # replays > 17 rows
    engine = V4BatchEngine(model, max_context=96, eos_ids=set(), chunk=32, num_blocks=13, max_step_tokens=96)
    seqs = run(engine, [(p, long) for p in prompts])
    assert [s.generated for s in seqs] == [generate_greedy(model, p, 40) for p in prompts]
    assert engine.scheduler.preemptions > 0
