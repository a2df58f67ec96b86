"""Greedy output of the real SmolLM2-135M (GGUF, CPU, float32) does not change with speculation.

For summaries and an extraction over aclsum papers (~500-650 prompt tokens), the output text's
SHA-256 and the token ids are the same with speculation off, prompt lookup and a draft model at
widths 1, 2, 4, 8 and 16. Draft models: SmolLM2's first 6 layers (+ final norm and head: a poor
drafter, so most steps reject and roll back) and SmolLM2 drafting for itself, whose every draft
must be accepted (acceptance exactly 1.0: verify lanes compute what decode steps compute).
"""
from __future__ import annotations

import functools

import pytest

from batchd.samples import aclsum_papers
from batchd.engine.runtime import Engine, EngineConfig
from batchd.engine.types import GenerationRequest, SamplingParams, SpeculationOptions

WIDTHS = [1, 2, 4, 8, 16]
MAX_NEW_TOKENS = 24


def summary(paper, chars: int = 1500) -> str:
    return (f"Summarise the paper below in three sentences.\n\n{paper.title}\n\n{paper.abstract}\n\n"
            f"{paper.body[:chars]}")


def extraction(paper, chars: int = 1800) -> str:
    return (f"Which datasets and evaluation metrics does this paper use? Answer with a short list.\n\n"
            f"{paper.title}\n\n{paper.abstract}\n\n{paper.body[:chars]}")


@functools.cache
def prompts() -> dict[str, str]:
    # two summaries and an extraction: on 2 CPU cores each wide verify step costs q + 1 decode
    # steps (lanes computed as decode rows), so the set is kept small enough for CI
    papers = aclsum_papers(limit=3)
    out = {f"summary-{p.paper_id}": summary(p) for p in papers[:2]}
    out[f"extraction-{papers[2].paper_id}"] = extraction(papers[2])
    return out


@pytest.fixture(scope="module")
def engine(smollm2_gguf) -> Engine:
    return Engine.load(str(smollm2_gguf), EngineConfig(device="cpu", dtype="float32", max_context=2048))


@pytest.fixture(scope="module")
def plain(engine):
    """Speculation off: the reference output of each prompt."""
    return {name: engine.generate(request(text, SpeculationOptions())) for name, text in prompts().items()}


def request(text: str, spec: SpeculationOptions) -> GenerationRequest:
    return GenerationRequest(prompt=text, chat=True, sampling=SamplingParams(max_new_tokens=MAX_NEW_TOKENS),
                             speculation=spec)


def drafter(engine: Engine, kind: str) -> str:
    return engine.checkpoint_path + "#layers=6" if kind == "first-6-layers" else engine.checkpoint_path


def assert_same_output(result, reference):
    assert result.token_ids == reference.token_ids
    assert result.token_ids_sha256 == reference.token_ids_sha256
    assert result.output_sha256 == reference.output_sha256
    assert result.finish_reason == reference.finish_reason


def test_prompts_are_real_and_mid_sized(engine, plain):
    for name, result in plain.items():
        assert 300 <= result.prompt_tokens <= 800, name
        assert len(result.token_ids) > 10, name
        assert "drafter_sha256" not in result.fingerprint  # no drafter drafted


@pytest.mark.parametrize("width", WIDTHS, ids=lambda w: f"w{w}")
@pytest.mark.parametrize("prompt", list(prompts()))
def test_prompt_lookup_leaves_greedy_output_unchanged(engine, plain, prompt, width):
    result = engine.generate(request(prompts()[prompt], SpeculationOptions("lookup", width=width)))
    assert_same_output(result, plain[prompt])
    assert result.telemetry.spec_steps > 0


@pytest.mark.parametrize("width", WIDTHS, ids=lambda w: f"w{w}")
@pytest.mark.parametrize("prompt", list(prompts())[::2])  # a summary and the extraction: drafting is slow
def test_first_layers_drafter_leaves_greedy_output_unchanged(engine, plain, prompt, width):
    spec = SpeculationOptions("draft", drafter_path=drafter(engine, "first-6-layers"), width=width)
    result = engine.generate(request(prompts()[prompt], spec))
    assert_same_output(result, plain[prompt])
    assert result.telemetry.spec_draft_tokens_offered > 0
    assert result.fingerprint["drafter_sha256"] == engine.checkpoint_sha256  # the GGUF's, layers cut


@pytest.mark.parametrize("width", [2, 8], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("prompt", list(prompts())[1:3])
def test_smollm2_drafting_for_itself_accepts_every_draft(engine, plain, prompt, width):
    spec = SpeculationOptions("draft", drafter_path=drafter(engine, "self"), width=width)
    result = engine.generate(request(prompts()[prompt], spec))
    assert_same_output(result, plain[prompt])
    t = result.telemetry
    assert t.acceptance_rate == 1.0 and set(t.acceptance_per_position) == {1.0}
    assert t.spec_draft_tokens_accepted == t.spec_draft_tokens_offered > 0


def test_drafters_share_the_targets_weights(engine, plain):
    truncated = engine.drafters[drafter(engine, "first-6-layers")]
    itself = engine.drafters[drafter(engine, "self")]
    assert truncated.config.num_layers == 6 and truncated.model.layers[5] is engine.model.layers[5]
    assert truncated.model.lm_head is engine.model.lm_head and itself.model is engine.model
    assert truncated.cache is not engine.cache and itself.cache is not engine.cache
