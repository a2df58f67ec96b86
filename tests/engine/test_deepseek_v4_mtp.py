"""DeepSeek V4's MTP layer as the drafter of `--spec draft` (engine.deepseek_v4.mtp).

The tiny checkpoints of test_deepseek_v4.py get random `mtp.0.*` tensors in DeepSeek's names: the
block's from a one-layer transformers model saved with save_pretrained (so `attn.wq_a`,
`ffn.experts.3.w1`, ...), plus e_proj, h_proj, enorm, hnorm, norm and hc_head_*. Random drafts are
rarely accepted, so some tests also replace the MTP's first drafts with the target's own greedy
tokens (after the MTP drafted, so its chained rows are written and rolled back all the same): then
drafts are accepted, partly, and the MTP's catch-up reads several verified rows at once.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("transformers without deepseek_v4 (needs >= 5.8)", allow_module_level=True)

from batchd.engine.deepseek_v4 import generate_greedy, load_folder  # noqa: E402
from batchd.engine.deepseek_v4.batch import V4BatchEngine  # noqa: E402
from batchd.engine.deepseek_v4.config import CSA, SLIDING  # noqa: E402
from batchd.engine.deepseek_v4.mtp import MTPDrafter, build_mtp  # noqa: E402
from batchd.engine.errors import UnsupportedFeatureError  # noqa: E402
from batchd.engine.types import GenerationRequest, SamplingParams, SpeculationOptions  # noqa: E402
from tests.engine.test_deepseek_v4 import TINY, reference_model  # noqa: E402

NEW_TOKENS = 12


def mtp_tensors(tmp_path, kind: str = SLIDING, seed: int = 5) -> dict[str, torch.Tensor]:
    """Random `mtp.0.*` tensors in DeepSeek's names for a TINY target; the block is of `kind`."""
    from safetensors.torch import load_file

    folder = tmp_path / f"mtp-block-{kind}"
    reference_model(seed, num_hidden_layers=1, layer_types=[kind], mlp_layer_types=["moe"]).save_pretrained(folder)
    saved = load_file(str(folder / "model.safetensors"))
    block = {name.removeprefix("model.layers.0."): value for name, value in saved.items()
             if name.startswith("model.layers.0.")}
    H, n = TINY["hidden_size"], TINY["hc_mult"]
    g = torch.Generator().manual_seed(seed)
    own = {"e_proj.weight": torch.randn(H, H, generator=g) * H**-0.5,
           "h_proj.weight": torch.randn(H, H, generator=g) * H**-0.5,
           "enorm.weight": 1 + 0.1 * torch.randn(H, generator=g), "hnorm.weight": 1 + 0.1 * torch.randn(H, generator=g),
           "norm.weight": 1 + 0.1 * torch.randn(H, generator=g), "hc_head_fn": 0.1 * torch.randn(n, n * H, generator=g),
           "hc_head_base": 0.5 * torch.randn(n, generator=g), "hc_head_scale": torch.ones(1)}
    return {f"mtp.0.{name}": value.contiguous() for name, value in (block | own).items()}


def write_v4_folder(folder, *, with_mtp: bool, kind: str = SLIDING):
    """A TINY target saved by transformers, with (or without) random mtp.* tensors in its file."""
    from safetensors.torch import load_file, save_file

    reference_model().save_pretrained(folder)
    if with_mtp:
        tensors = load_file(str(folder / "model.safetensors")) | mtp_tensors(folder, kind)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module", params=[SLIDING, CSA], ids=["sliding-mtp", "csa-mtp"])
def loaded(request, tmp_path_factory):
    """(target, its MTP layer): V4-Flash's MTP block is sliding-window; a CSA one rolls back its
    compressor and indexer too."""
    model, aside = load_folder(write_v4_folder(tmp_path_factory.mktemp("v4-mtp"), with_mtp=True, kind=request.param))
    return model, build_mtp(model, aside.mtp, "test")


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def request(spec: str = "none", width=None, **sampling) -> GenerationRequest:
    return GenerationRequest(sampling=SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, **sampling),
                             speculation=SpeculationOptions(method=spec, width=width))


def run(engine: V4BatchEngine, jobs) -> list:
    seqs = [engine.submit(prompt, req) for prompt, req in jobs]
    while engine.has_work:
        engine.step()
    return seqs


def with_oracle_drafts(engine: V4BatchEngine, jobs: dict[int, tuple[list[int], list[int]]], right: int = 2) -> None:
    """After the MTP drafts (its chained rows written and rolled back), replace its first `right`
    drafts by the target's greedy tokens. `jobs`: seq_id -> (prompt, generate_greedy's tokens)."""
    propose_many = engine.mtp.propose_many

    def oracle(requests):
        out = []
        for (state, tokens, _, _), drafts in zip(requests, propose_many(requests)):
            seq_id = next(i for i, s in engine._mtp_states.items() if s is state)
            prompt, expected = jobs[seq_id]
            truth = expected[len(tokens) - len(prompt) : len(tokens) - len(prompt) + right]
            out.append((truth + drafts[len(truth):])[: len(drafts)])
        return out

    engine.mtp.propose_many = oracle


def assert_same_valid_parts(ours, theirs, length: int) -> None:
    """Two MTP LayerCaches agree on every part below `length`: rows and projections by position,
    the compressors' entries whose windows closed by then (what a rollback must restore)."""
    assert torch.allclose(ours.rows.tensor[:, :length], theirs.rows.tensor[:, :length], rtol=0, atol=1e-4)
    for mine, other in ((ours.compressor, theirs.compressor), (ours.indexer, theirs.indexer)):
        if mine is None:
            continue
        for part, end in (("kv", length), ("gate", length), ("entries", length // mine.rate)):
            a, b = getattr(mine, part).tensor[:, :end], getattr(other, part).tensor[:, :end]
            assert torch.allclose(a, b, rtol=0, atol=1e-4), part


def test_the_mtp_layer_is_built_from_the_set_aside_tensors_with_its_kind(loaded, tmp_path):
    model, mtp = loaded
    assert mtp is not None and mtp.config.num_layers == 1 and mtp.config.mlp_layer_types == ["moe"]
    assert mtp.config.layer_types[0] in (SLIDING, CSA)
    assert (mtp.config.layer_types[0] == CSA) == (mtp.layers[0].self_attn.compressor is not None)
    assert mtp.hc_head.hc_fn.dtype == torch.float32 and mtp.e_proj.weight.dtype == model.dtype
    # every tensor went somewhere: load_tensors refuses missing and unexpected names
    _, aside = load_folder(write_v4_folder(tmp_path / "plain", with_mtp=False))
    assert build_mtp(model, aside.mtp) is None


def assert_drafting_keeps_greedy_output(model, mtp, prompts) -> None:
    """MTP drafting at a fixed and an adaptive width, each prompt alone and all batched, gives
    plain greedy decoding's tokens (shared with the bf16 tests)."""
    expected = [generate_greedy(model, p, NEW_TOKENS) for p in prompts]
    for width in (3, None):   # fixed, and adaptive
        alone = [run(V4BatchEngine(model, max_context=128, eos_ids=set(), chunk=16, mtp=mtp),
                     [(p, request("draft", width))])[0] for p in prompts]
        batched = run(V4BatchEngine(model, max_context=128, eos_ids=set(), chunk=16, mtp=mtp),
                      [(p, request("draft", width)) for p in prompts])
        assert [s.generated for s in alone] == expected == [s.generated for s in batched]
        assert all(s.spec_steps > 0 and s.spec_offered >= s.spec_steps for s in alone + batched)


def test_mtp_greedy_output_is_the_targets_alone_and_batched(loaded):
    model, mtp = loaded
    assert_drafting_keeps_greedy_output(model, mtp, [ids(40, 1), ids(23, 2), ids(57, 3)])


def test_accepted_drafts_keep_the_output_and_the_mtp_cache_equals_a_fresh_one(loaded):
    """Oracle drafts: some accepted (2 of 3 at most), the third usually rejected. At the end the
    MTP's cache and its next guess equal those of a fresh MTP fed the target's streams at once."""
    model, mtp = loaded
    prompts = [ids(40, 4), ids(29, 5)]
    expected = [generate_greedy(model, p, NEW_TOKENS) for p in prompts]
    engine = V4BatchEngine(model, max_context=128, eos_ids=set(), chunk=16, mtp=mtp)
    seqs = [engine.submit(p, request("draft", width=3)) for p in prompts]
    with_oracle_drafts(engine, {s.seq_id: (p, e) for s, p, e in zip(seqs, prompts, expected)})
    states = [engine._mtp_states[s.seq_id] for s in seqs]
    while engine.has_work:
        engine.step()
    assert [s.generated for s in seqs] == expected
    assert all(0 < s.spec_accepted < s.spec_offered for s in seqs)
    for seq, state in zip(seqs, states):
        length = state.cache.length
        tokens = seq.tokens()
        target_cache = model.new_cache(length)
        streams = model.hidden(torch.tensor([tokens[:length]]), target_cache)[0]
        fresh = MTPDrafter(model, mtp).new_state(length + 1)
        MTPDrafter(model, mtp).observe(fresh, 0, streams, tokens[: length + 1])
        assert fresh.cache.length == length
        assert_same_valid_parts(state.cache.layers[0], fresh.cache.layers[0], length)
        assert torch.allclose(state.logits, fresh.logits, rtol=0, atol=1e-3)


def test_the_drafters_rollback_restores_its_cache_exactly(loaded):
    """Drive the drafter by hand: chained drafts written past the context and rolled back, then the
    accepted positions' target streams in pieces of 1..3 rows; against one fresh pass over them all."""
    model, mtp = loaded
    tokens = ids(48, 6)
    streams = model.hidden(torch.tensor([tokens]), model.new_cache(48))[0]        # [48, n, H]
    drafter = MTPDrafter(model, mtp)
    state, fresh = drafter.new_state(64), drafter.new_state(64)
    drafter.observe(state, 0, streams[:20], tokens[:21])
    position = 20
    for accepted in (0, 2, 1, 0, 2, 2, 1):
        drafts = drafter.propose(state, tokens[: position + 1], 4)
        assert len(drafts) == 4 and state.cache.length == position
        drafter.observe(state, position, streams[position : position + 1 + accepted], tokens[: position + 2 + accepted])
        position += 1 + accepted
    drafter.observe(fresh, 0, streams[:position], tokens[: position + 1])
    assert state.cache.length == fresh.cache.length == position
    assert_same_valid_parts(state.cache.layers[0], fresh.cache.layers[0], position)
    assert torch.allclose(state.logits, fresh.logits, rtol=0, atol=1e-3)
    # the row at position t reads the target's streams at t and the token at t + 1
    _, direct = mtp(model, streams[None, :position], torch.tensor([tokens[1 : position + 1]]), mtp.new_cache(64))
    assert torch.allclose(fresh.logits, direct[0], rtol=0, atol=1e-4)
    assert drafter.propose(state, tokens[: position + 1], 3) == drafter.propose(fresh, tokens[: position + 1], 3)


def test_preemption_and_a_shared_prefix_keep_the_output(loaded):
    model, mtp = loaded
    prompts = [ids(40, 7), ids(36, 8), ids(44, 9)]
    expected = [generate_greedy(model, p, NEW_TOKENS) for p in prompts]
    engine = V4BatchEngine(model, max_context=64, eos_ids=set(), chunk=16, num_blocks=9, max_step_tokens=64, mtp=mtp)
    assert [s.generated for s in run(engine, [(p, request("draft", 2)) for p in prompts])] == expected
    assert engine.scheduler.preemptions > 0
    prefix = ids(32, 10)
    shared = [prefix + ids(6, 11), prefix + ids(9, 12)]
    engine = V4BatchEngine(model, max_context=128, eos_ids=set(), chunk=16, mtp=mtp)
    first = run(engine, [(shared[0], request("draft", 3))])[0]
    second = run(engine, [(shared[1], request("draft", 3))])[0]
    assert second.shared_chunks > 0
    assert [first.generated, second.generated] == [generate_greedy(model, p, NEW_TOKENS) for p in shared]


def test_a_sampled_job_drafting_with_the_mtp_is_reproducible(loaded):
    model, mtp = loaded
    job = (ids(30, 13), request("draft", 3, temperature=0.8, seed=4))
    runs = [run(V4BatchEngine(model, max_context=128, eos_ids=set(), chunk=16, mtp=mtp), [job])[0] for _ in range(2)]
    assert runs[0].generated == runs[1].generated and len(runs[0].generated) == NEW_TOKENS
    assert runs[0].spec_offered > 0


def test_sampled_drafts_come_with_the_distributions_they_were_drawn_from(loaded):
    """A sampling job's drafts are drawn from the MTP's filtered distribution (kept for rejection
    sampling); a greedy job's are its argmax, with no distributions."""
    from batchd.engine.sampling import Sampler

    model, mtp = loaded
    tokens = ids(30, 15)
    streams = model.hidden(torch.tensor([tokens]), model.new_cache(30))[0]
    drafter = MTPDrafter(model, mtp)
    state = drafter.new_state(40)
    drafter.observe(state, 0, streams, tokens)
    sampler = Sampler(SamplingParams(temperature=0.8, top_k=20, seed=1), "cpu")
    drafts = drafter.propose(state, tokens, 3, sampler)
    assert state.probs.shape == (3, TINY["vocab_size"]) and state.cache.length == 29
    assert torch.allclose(state.probs.sum(-1), torch.ones(3)) and all((state.probs > 0).sum(-1) <= 20)
    assert all(state.probs[i, d] > 0 for i, d in enumerate(drafts))
    greedy = drafter.propose(state, tokens, 3)
    assert state.probs is None and greedy[0] == int(state.logits.argmax())


def test_a_checkpoint_without_mtp_says_so_and_refuses_draft(tmp_path):
    model, aside = load_folder(write_v4_folder(tmp_path, with_mtp=False))
    assert "no MTP layer" in aside.notes[0] and "--spec draft is refused" in aside.notes[0]
    engine = V4BatchEngine(model, max_context=128, eos_ids=set(), mtp=build_mtp(model, aside.mtp))
    with pytest.raises(UnsupportedFeatureError, match="MTP layer.*has none.*--spec lookup"):
        engine.submit(ids(10, 14), request("draft"))
    assert run(engine, [(ids(10, 14), request("lookup"))])[0].generated   # the rest still runs


VOCAB = 320


def served_folder(folder, *, with_mtp: bool):
    """A TINY target with a tokenizer (as a worker serves it), with or without random mtp.*."""
    from safetensors.torch import load_file, save_file

    from tests.engine.test_checkpoint_builders import tiny_tokenizer, write_hf_folder

    folder = write_hf_folder(folder, reference_model(vocab_size=VOCAB), tiny_tokenizer(VOCAB))
    if with_mtp:
        tensors = load_file(str(folder / "model.safetensors")) | mtp_tensors(folder)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_a_served_v4_folder_with_mtp_drafts_and_reports_acceptance(tmp_path):
    """Engine.load on a folder with a tokenizer and mtp.*: the load notes say the MTP layer drafts;
    a --spec draft job has the plain job's tokens and the speculation telemetry."""
    from batchd.engine.runtime import Engine, EngineConfig
    from tests.engine.test_checkpoint_builders import TEXT

    engine = Engine.load(str(served_folder(tmp_path, with_mtp=True)), EngineConfig(device="cpu", max_context=256))
    assert engine.mtp is not None and any("drafter of --spec draft" in note for note in engine.notes)
    sampling = SamplingParams(max_new_tokens=8, ignore_eos=True)
    plain = engine.generate(GenerationRequest(prompt=TEXT[:300], sampling=sampling))
    drafted = engine.generate(GenerationRequest(prompt=TEXT[:300], sampling=sampling,
                                                speculation=SpeculationOptions(method="draft", width=2)))
    assert drafted.token_ids == plain.token_ids
    t = drafted.telemetry
    assert t.spec_method == "draft" and t.spec_steps > 0 and t.spec_draft_tokens_offered >= t.spec_steps
    assert t.acceptance_rate == t.spec_draft_tokens_accepted / t.spec_draft_tokens_offered
    assert drafted.fingerprint["drafter_path"] == "mtp.0"


def test_batchd_generate_spec_draft_on_a_v4_folder_needs_no_drafter(tmp_path):
    """The CLI: a V4 folder drafts with its MTP layer; one without mtp.* refuses with the reason."""
    import json

    from click.testing import CliRunner

    from batchd.cli.generate import generate

    args = ["--prompt", "Name a colour.", "--max-new-tokens", "4", "--ignore-eos", "--spec", "draft", "--json"]
    result = CliRunner().invoke(generate, ["--model", str(served_folder(tmp_path / "mtp", with_mtp=True)), *args])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["telemetry"]["spec_method"] == "draft"
    result = CliRunner().invoke(generate, ["--model", str(served_folder(tmp_path / "plain", with_mtp=False)), *args])
    assert isinstance(result.exception, UnsupportedFeatureError) and "has none" in str(result.exception)


def test_an_incomplete_mtp_layer_leaves_the_target_serving_and_says_why(tmp_path):
    from safetensors.torch import load_file, save_file

    from batchd.engine.runtime import Engine, EngineConfig

    folder = served_folder(tmp_path, with_mtp=False)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["mtp.0.enorm.weight"] = torch.ones(TINY["hidden_size"])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    engine = Engine.load(str(folder), EngineConfig(device="cpu", max_context=256))
    assert engine.mtp is None and "cannot be built" in engine.notes[0] and "missing" in engine.notes[0]
    assert engine.generate(GenerationRequest(prompt="Name a colour.", sampling=SamplingParams(max_new_tokens=2)))
