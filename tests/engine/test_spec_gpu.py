"""CUDA only: greedy output with speculation equals plain decoding on the GPU (bf16, CUDA graphs,
the batch-invariant small-step kernels). Random weights at real shapes; skipped without a GPU.

Run on the device machine:  pytest tests/engine/test_spec_gpu.py -q
"""
from __future__ import annotations

import pytest
import torch

from batchd.engine.presets import preset
from batchd.engine.runtime import Engine, EngineConfig
from batchd.engine.sampling import Sampler
from batchd.engine.speculative import PromptLookupProposer, generate_speculative, self_drafter, truncated_drafter
from batchd.engine.stopping import StopChecker
from batchd.engine.types import GenerationRequest, SamplingParams, SpeculationOptions, Telemetry

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

WIDTHS = [1, 2, 4, 8, 16]
_tokens = torch.randint(0, 49152, (200,), generator=torch.Generator().manual_seed(0)).tolist()
PROMPT = _tokens + _tokens[:100]  # a repeat, so that prompt lookup finds matches


@pytest.fixture(scope="module", params=["smollm2-135m", "qwen2.5-0.5b"])
def engine(request):
    engine = Engine.from_config(preset(request.param), EngineConfig(device="cuda", dtype="bf16", max_context=1024),
                                seed=1)
    engine.drafters.register("self", self_drafter(engine.drafters.target))
    engine.drafters.register("first-6-layers", truncated_drafter(engine.drafters.target, 6))
    yield engine
    engine.close()


def generate(engine: Engine, spec: SpeculationOptions, new_tokens: int = 64):
    telemetry = Telemetry()
    request = GenerationRequest(sampling=SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), speculation=spec)
    return engine.generate_ids(PROMPT, request, telemetry), telemetry


def generate_with_lookup(engine: Engine, width: int, new_tokens: int = 64):
    """Prompt lookup that also matches single tokens: random models rarely repeat a bigram."""
    telemetry = Telemetry()
    engine.cache.reset()
    out = generate_speculative(engine, PROMPT, Sampler(SamplingParams(), engine.device),
                               StopChecker(set(), new_tokens), SpeculationOptions("lookup", width=width), telemetry,
                               proposer=PromptLookupProposer(engine.device, min_n=1, max_n=4))
    return out, telemetry


@pytest.fixture(scope="module")
def plain(engine):
    return generate(engine, SpeculationOptions())[0].token_ids


@pytest.mark.parametrize("width", WIDTHS, ids=lambda w: f"w{w}")
@pytest.mark.parametrize("method", ["lookup", "draft-self", "draft-first-6-layers"])
def test_greedy_ids_identical_to_plain_on_gpu(engine, plain, method, width):
    if method == "lookup":
        out, t = generate_with_lookup(engine, width)
    else:
        out, t = generate(engine, SpeculationOptions("draft", drafter_path=method.removeprefix("draft-"), width=width))
    assert out.token_ids == plain
    assert t.spec_steps > 0
    if method == "draft-self":
        assert t.acceptance_rate == 1.0
    assert not any("at most" in note for note in t.notes)  # width 16: 17 verify rows, graphed


def test_adaptive_width_identical_to_plain_on_gpu(engine, plain):
    for spec in (SpeculationOptions("lookup"), SpeculationOptions("draft", drafter_path="self")):
        assert generate(engine, spec)[0].token_ids == plain


def test_graphs_off_gives_the_same_speculative_output(engine, plain):
    eager = Engine(engine.model, None, EngineConfig(max_context=1024, cuda_graphs=False), eos_ids=set())
    eager.drafters.register("self", self_drafter(eager.drafters.target))
    out, t = generate(eager, SpeculationOptions("draft", drafter_path="self", width=4))
    assert out.token_ids == plain and t.acceptance_rate == 1.0
