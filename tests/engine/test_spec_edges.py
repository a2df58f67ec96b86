"""Speculative decoding on tiny random models: greedy output equal to plain decoding at every
width and method, stop rules inside an accepted run, a nearly full cache, telemetry, refusals."""
from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from batchd.engine.errors import BadInputError
from batchd.engine.generate import generate_plain
from batchd.engine.runtime import Engine, EngineConfig
from batchd.engine.sampling import Sampler
from batchd.engine.speculative import (PromptLookupProposer, WidthPolicy, generate_speculative, self_drafter,
                                truncated_drafter)
from batchd.engine.speculative.adaptive import best_width
from batchd.engine.speculative.decode import make_proposer
from batchd.engine.stopping import StopChecker
from batchd.engine.text import TextCodec
from batchd.engine.types import GenerationRequest, SamplingParams, SpeculationOptions, Telemetry
from tests.engine.tiny_models import TINY, hf_model, ours_from_hf

pytest.importorskip("transformers")

WIDTHS = [1, 2, 4, 8, 16, None]
DRAFTERS = {"self": lambda e: self_drafter(e.drafters.target),
            "first-layer": lambda e: truncated_drafter(e.drafters.target, 1)}


def tiny_engine(arch: str = "llama", max_context: int = 256, vocab_size: int = 512, codec=None,
                checkpoint_sha256: str = "") -> Engine:
    hf = hf_model(arch) if vocab_size == TINY["vocab_size"] else _hf_with_vocab(arch, vocab_size)
    engine = Engine(ours_from_hf(hf), codec, EngineConfig(max_context=max_context), eos_ids=set(),
                    checkpoint_sha256=checkpoint_sha256)
    for name, build in DRAFTERS.items():
        engine.drafters.register(name, build(engine))
    return engine


def _hf_with_vocab(arch: str, vocab_size: int):
    import tests.engine.tiny_models as tiny

    saved = dict(tiny.TINY)
    tiny.TINY["vocab_size"] = vocab_size
    try:
        return hf_model(arch)
    finally:
        tiny.TINY.clear()
        tiny.TINY.update(saved)


# random tokens, then a repeat of their first half: prompt lookup has something to copy
_tokens = torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(0)).tolist()
PROMPT = _tokens + _tokens[:35]


def generate(engine: Engine, spec: SpeculationOptions, max_new_tokens: int = 48, **sampling):
    telemetry = Telemetry()
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=not engine.eos_ids, **sampling)
    out = engine.generate_ids(PROMPT, GenerationRequest(sampling=params, speculation=spec), telemetry)
    return out, telemetry


def spec_options(method: str, width) -> SpeculationOptions:
    if method == "lookup":
        return SpeculationOptions("lookup", width=width)
    return SpeculationOptions("draft", drafter_path=method.removeprefix("draft-"), width=width)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def engine_and_plain(request):
    engine = tiny_engine(request.param)
    return engine, generate(engine, SpeculationOptions())[0]


@pytest.mark.parametrize("width", WIDTHS, ids=lambda w: f"w{w or 'auto'}")
@pytest.mark.parametrize("method", ["lookup", "draft-self", "draft-first-layer"])
def test_greedy_ids_identical_to_plain(engine_and_plain, method, width):
    engine, plain = engine_and_plain
    if method == "lookup":  # random models rarely repeat a bigram: let single tokens match
        telemetry = Telemetry()
        spec = run_direct(engine, StopChecker(set(), 48), spec_options(method, width), telemetry,
                          proposer=PromptLookupProposer("cpu", min_n=1, max_n=4))
    else:
        spec, telemetry = generate(engine, spec_options(method, width))
    assert spec.token_ids == plain.token_ids
    assert spec.finish_reason == plain.finish_reason == "length"
    assert telemetry.spec_steps > 0


def run_direct(engine: Engine, stopper: StopChecker, spec: SpeculationOptions | None, telemetry=None, **kwargs):
    """Below Engine.generate_ids: no context-fit check, a hand-made stop checker."""
    engine.cache.reset()
    sampler = Sampler(SamplingParams(), engine.device)
    if spec is None:
        return generate_plain(engine.runner, PROMPT, sampler, stopper)
    return generate_speculative(engine, PROMPT, sampler, stopper, spec, telemetry or Telemetry(), **kwargs)


def first_new_position(tokens: list[int], after: int) -> int:
    """An index >= after whose token does not occur earlier in `tokens`."""
    return next(i for i in range(after, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.mark.parametrize("method", ["lookup", "draft-self"])
def test_eos_inside_an_accepted_run_ends_the_output_there(method):
    engine = tiny_engine()
    plain_ids = generate(engine, SpeculationOptions())[0].token_ids
    k = first_new_position(plain_ids, 12)
    engine.eos_ids = {plain_ids[k]}
    plain, _ = generate(engine, SpeculationOptions())
    spec, telemetry = generate(engine, spec_options(method, 8))
    assert plain.token_ids == plain_ids[:k] and plain.finish_reason == "eos"
    assert spec.token_ids == plain.token_ids and spec.finish_reason == "eos"
    if method == "draft-self":  # runs of 9 tokens from token 1: the EOS sits inside one
        assert telemetry.acceptance_rate == 1.0 and k % 9 != 1


@pytest.mark.parametrize("max_new_tokens", [1, 2, 13, 17])
def test_max_new_tokens_is_respected_mid_run(max_new_tokens):
    engine = tiny_engine()
    plain, _ = generate(engine, SpeculationOptions(), max_new_tokens=max_new_tokens)
    spec, _ = generate(engine, spec_options("draft-self", 8), max_new_tokens=max_new_tokens)
    assert len(spec.token_ids) == max_new_tokens and spec.finish_reason == "length"
    assert spec.token_ids == plain.token_ids


def test_stop_string_inside_an_accepted_run():
    engine = tiny_engine()
    decode = lambda ids: "".join(f"<{i}>" for i in ids)  # noqa: E731
    plain_ids = run_direct(engine, StopChecker(set(), 40), None).token_ids
    k = first_new_position(plain_ids, 12)
    stop = f"<{plain_ids[k]}>"
    results = [run_direct(engine, StopChecker(set(), 40, (stop,), decode), spec)
               for spec in (None, spec_options("draft-self", 8), spec_options("lookup", 16))]
    for out in results:
        assert out.finish_reason == "stop" and out.token_ids == plain_ids[: k + 1]


@pytest.mark.parametrize("method", ["lookup", "draft-self"])
def test_nearly_full_cache_ends_like_plain_decoding(method):
    engine = tiny_engine(max_context=len(PROMPT) + 10)
    plain = run_direct(engine, StopChecker(set(), 40), None)
    spec = run_direct(engine, StopChecker(set(), 40), spec_options(method, 16))
    assert plain.finish_reason == spec.finish_reason == "length"
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) == 11
    assert engine.cache.length <= engine.cache.max_len


@pytest.mark.parametrize("method", ["lookup", "draft-first-layer"])
def test_sampling_is_reproducible_with_a_seed(method):
    engine = tiny_engine()
    options = spec_options(method, 4)
    runs = [generate(engine, options, temperature=0.9, top_k=50, seed=seed)[0].token_ids for seed in (3, 3, 4)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_self_drafting_accepts_every_draft_and_fills_telemetry():
    engine = tiny_engine()
    out, t = generate(engine, spec_options("draft-self", 4), max_new_tokens=41)
    assert t.spec_method == "draft" and not t.spec_disabled
    assert t.acceptance_rate == 1.0 and t.spec_draft_tokens_accepted == t.spec_draft_tokens_offered
    assert t.acceptance_per_position == [1.0] * 4
    assert t.spec_steps == 8 and t.mean_accepted_length == 5.0  # 1 prefill token + 8 steps of 4 + bonus
    assert t.draft_s > 0 and t.verify_s > 0
    row = t.as_dict()
    for key in ("spec_steps", "acceptance_rate", "mean_accepted_length", "acceptance_per_position", "draft_s",
                "verify_s", "spec_disabled", "spec_disabled_reason"):
        assert key in row


class CostedProposer:
    """A proposer that charges a virtual clock what each step costs, so that switching off is
    decided by a cost model, not by this machine's load: `draft_s` per drafted token, and a
    target forward of `step_s` plus `lane_s` per draft (it runs between propose() and
    accepted(); a step with nothing proposed is a plain decode step)."""

    def __init__(self, inner, *, draft_s: float, step_s: float = 1.0, lane_s: float = 0.1):
        self.inner, self.draft_s, self.step_s, self.lane_s = inner, draft_s, step_s, lane_s
        self.now, self.offered = 0.0, 0

    def __call__(self) -> float:  # the clock
        return self.now

    def begin(self, prompt_ids):
        self.inner.begin(prompt_ids)

    def propose(self, context, width):
        proposal = self.inner.propose(context, width)
        self.offered = len(proposal)
        self.now += self.draft_s * self.offered
        return proposal

    def accepted(self, num_accepted):
        self.inner.accepted(num_accepted)
        self.now += self.step_s + self.lane_s * self.offered
        self.offered = 0


@pytest.mark.parametrize("drafter, draft_s, switched_off", [
    ("first-layer", 0.5, True),  # ~10% acceptance, each draft half a target step: dearer per token
    ("self", 0.0, False),  # every draft accepted, drafting free: 1 + 0.1 q per q + 1 tokens
], ids=["poor-drafter-switches-off", "free-exact-drafter-stays-on"])
def test_speculation_switches_itself_off_exactly_when_it_does_not_pay(drafter, draft_s, switched_off):
    engine = tiny_engine()
    plain = run_direct(engine, StopChecker(set(), 120), None)
    options, telemetry = spec_options(f"draft-{drafter}", None), Telemetry()
    sampler = Sampler(SamplingParams(), engine.device)
    proposer = CostedProposer(make_proposer(engine.drafters, engine.device, options, sampler, telemetry),
                              draft_s=draft_s)
    spec = run_direct(engine, StopChecker(set(), 120), options, telemetry, proposer=proposer,
                      policy=WidthPolicy(clock=proposer))
    assert telemetry.spec_disabled == switched_off
    if switched_off:
        assert "plain decode's 1000.00 ms" in telemetry.spec_disabled_reason
    assert spec.token_ids == plain.token_ids


def test_fingerprint_names_the_drafter_checkpoint_only_when_a_drafter_drafts():
    engine = tiny_engine(checkpoint_sha256="a" * 64)
    engine.drafters.register("first-layer-of-a", truncated_drafter(engine.drafters.target, 1))
    other = Engine(ours_from_hf(hf_model("llama", seed=1)), None, EngineConfig(max_context=256), eos_ids=set(),
                   checkpoint_sha256="b" * 64, checkpoint_path="other.gguf")
    engine.drafters.register("other.gguf", other)
    cases = [(SpeculationOptions(), None), (SpeculationOptions("lookup", drafter_path="other.gguf"), None),
             (SpeculationOptions("draft", drafter_path="other.gguf"), "b" * 64),
             (SpeculationOptions("draft", drafter_path="first-layer-of-a"), "a" * 64)]  # the file's hash
    for spec, drafter_sha256 in cases:
        fingerprint = engine.fingerprint(GenerationRequest(speculation=spec))
        assert fingerprint.get("drafter_sha256") == drafter_sha256, spec
        assert fingerprint["target_sha256"] == "a" * 64


@pytest.mark.parametrize("alpha, cost_per_draft, width", [(1.0, 0.1, 16), (0.7, 0.05, 6), (0.9, 0.1, 10),
                                                         (0.5, 0.1, 2), (0.3, 0.4, 1)])
def test_width_maximises_expected_tokens_per_unit_of_cost(alpha, cost_per_draft, width):
    def tokens_per_cost(q):  # geometric acceptance, bonus token included, cost in plain steps
        return sum(alpha**i for i in range(q + 1)) / (1 + cost_per_draft * q)

    assert best_width(alpha, cost_per_draft) == width
    assert all(tokens_per_cost(width) >= tokens_per_cost(q) for q in range(1, 17))


def test_width_policy_adapts_and_switches_off():
    policy = WidthPolicy()
    assert [policy.width() for _ in range(2)] == [0, 0]  # timing plain steps first
    for _ in range(4):
        policy.record_plain_step(0.010)
    assert policy.width() == 6  # prior acceptance 0.7, lanes at 5% of a step: E(q) / C(q) peaks at q = 6
    for _ in range(20):
        policy.record_spec_step(offered=16, accepted=16, tokens=17, seconds=0.012, draft_s=0.0)
    assert policy.width() == 16 and not policy.disabled
    widths = []
    for _ in range(30):  # drafts rejected, but cheap steps: narrower and narrower, still on
        policy.record_spec_step(offered=2, accepted=0, tokens=1, seconds=0.009, draft_s=0.001)
        widths.append(policy.width())
    assert widths == sorted(widths, reverse=True) and widths[9] < 4 and widths[-1] == 1
    assert not policy.disabled
    for _ in range(12):  # a window of steps dearer per token than plain decoding
        policy.record_spec_step(offered=1, accepted=0, tokens=1, seconds=0.015, draft_s=0.004)
    assert policy.disabled and "plain decode's 10.00 ms" in policy.disabled_reason
    assert policy.width() == 0
    fixed = WidthPolicy(4)
    for _ in range(20):
        fixed.record_spec_step(offered=4, accepted=0, tokens=1, seconds=1.0, draft_s=0.5)
    assert fixed.width() == 4 and not fixed.disabled  # a width the job fixed is honoured


def test_prompt_lookup_prefers_the_longest_match_then_the_latest():
    lookup = PromptLookupProposer("cpu", min_n=1, max_n=3)
    lookup.begin([])
    # "1 2 3" was followed by 4; the later "2 3" by 5: the 3-gram wins, with the full width
    assert lookup.propose([1, 2, 3, 4, 7, 2, 3, 5, 1, 2, 3], 3).tokens.tolist() == [4, 7, 2]
    lookup.begin([])
    # the latest "9" is followed by 7; a 1-gram match proposes a third of the width
    assert lookup.propose([9, 8, 9, 7, 9], 6).tokens.tolist() == [7, 9]
    lookup.begin([])
    assert lookup.propose([1, 2, 3], 4).tokens.tolist() == []  # the suffix never matches itself
    default = PromptLookupProposer("cpu")
    default.begin([])
    assert default.propose([9, 8, 9, 7, 9], 6).tokens.tolist() == []  # single-token matches: no proposal


def test_mismatched_vocabulary_is_refused_with_both_sizes():
    target = tiny_engine()
    small = Engine(ours_from_hf(_hf_with_vocab("llama", 256)), None, EngineConfig(max_context=256), eos_ids=set())
    with pytest.raises(BadInputError, match=r"256 tokens, the target 512"):
        target.drafters.register("small", small)


def word_codec(words: list[str]) -> TextCodec:
    return TextCodec(Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0])))


def test_same_size_but_different_tokenizer_is_refused():
    target = tiny_engine(codec=word_codec([f"w{i}" for i in range(512)]))
    drafter = tiny_engine(codec=word_codec([f"v{i}" for i in range(512)]))
    with pytest.raises(BadInputError, match="tokenizer"):
        target.drafters.register("other", drafter)


@pytest.mark.parametrize("options, message", [
    (SpeculationOptions("lookup", width=0), "between 1 and 16"),
    (SpeculationOptions("lookup", width=17), "between 1 and 16"),
    (SpeculationOptions("draft"), "needs --drafter"),
    (SpeculationOptions("draft", drafter_path="/nonexistent/drafter.gguf"), "does not exist"),
    (SpeculationOptions("draft", drafter_path="x.gguf#depth=3"), "#layers=N"),
], ids=["width-0", "width-17", "draft-without-drafter", "missing-drafter", "bad-suffix"])
def test_bad_options_are_refused(options, message):
    with pytest.raises(BadInputError, match=message):
        generate(tiny_engine(), options)
