"""A DeepSeek V4 folder served as a worker serves any target: `Engine.load` returns its
V4Engine, and requests (text in, text out) run through engine.batch.generate's session over the
V4 batch engine. Greedy tokens equal transformers' generate; what the row refuses fails that
request alone, with the reason."""
from __future__ import annotations

import hashlib

import pytest

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("transformers without deepseek_v4 (needs >= 5.8)", allow_module_level=True)

import torch  # noqa: E402

from batchd.engine.deepseek_v4.serving import V4Engine  # noqa: E402
from batchd.engine.errors import UnsupportedFeatureError  # noqa: E402
from batchd.engine.runtime import Engine, EngineConfig  # noqa: E402
from batchd.engine.types import (CompressionOptions, GenerationRequest, SamplingParams,  # noqa: E402
                                 SpeculationOptions)
from tests.engine.test_checkpoint_builders import TEXT, tiny_hf_model, tiny_tokenizer, write_hf_folder  # noqa: E402
from tests.engine.test_deepseek_v4 import reference_model  # noqa: E402

VOCAB = 320
NEW_TOKENS = 8
PROMPT = TEXT[:400]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(transformers' model, the folder, the engine Engine.load gives for it)."""
    reference = reference_model(vocab_size=VOCAB)
    folder = write_hf_folder(tmp_path_factory.mktemp("v4-served"), reference, tiny_tokenizer(VOCAB))
    return reference, folder, Engine.load(str(folder), EngineConfig(device="cpu", max_context=256))


def request(**kwargs) -> GenerationRequest:
    spec = kwargs.pop("speculation", SpeculationOptions())
    return GenerationRequest(prompt=PROMPT, sampling=SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
                             speculation=spec, **kwargs)


def test_engine_load_serves_a_v4_folder_with_transformers_greedy_tokens(served):
    reference, folder, engine = served
    assert isinstance(engine, V4Engine)
    result = engine.generate(request())
    prompt_ids = engine.codec.encode(PROMPT)
    assert len(prompt_ids) > 3 * 16   # past the window and several blocks of both compressors
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt_ids):].tolist()
    assert result.token_ids == expected
    assert result.output_sha256 == hashlib.sha256(result.text.encode("utf-8")).hexdigest()
    assert result.fingerprint["target_sha256"] and result.fingerprint["architecture"] == "deepseek_v4"
    assert any("MTP layer" in note for note in result.telemetry.notes)


def test_jobs_together_with_lookup_keep_their_tokens_and_refusals_fail_alone(served):
    _, _, engine = served
    alone = engine.generate(request()).token_ids
    outcomes = dict(engine.generate_many([
        request(), request(speculation=SpeculationOptions(method="lookup", width=3)),
        request(speculation=SpeculationOptions(method="draft", drafter_path="/models/x")),
        request(compression=CompressionOptions(mode="always", drafter_path="/models/no-such-drafter")),
    ]))
    assert outcomes[0].token_ids == alone and outcomes[1].token_ids == alone
    assert isinstance(outcomes[2], UnsupportedFeatureError) and "MTP layer" in str(outcomes[2])
    assert isinstance(outcomes[3], Exception) and "no-such-drafter" in str(outcomes[3])


def test_pflash_compresses_v4_prompts_with_a_small_dense_drafter(served, tmp_path_factory):
    """A tiny llama drafter (the same tokenizer) scores V4's prompts: jobs that ask are compressed
    (telemetry, fingerprint), give the same tokens alone and batched, and a job without PFlash
    beside them keeps its own tokens."""
    _, _, engine = served
    drafter = write_hf_folder(tmp_path_factory.mktemp("v4-pflash-drafter"), tiny_hf_model("llama", VOCAB),
                              tiny_tokenizer(VOCAB))
    options = CompressionOptions(mode="always", keep_ratio=0.3, drafter_path=str(drafter))
    alone = engine.generate(request(compression=options))
    outcomes = dict(engine.generate_many([request(compression=options), request(), request(compression=options)]))
    prompt_tokens = len(engine.codec.encode(PROMPT))
    for result in (alone, outcomes[0], outcomes[2]):
        assert result.telemetry.compressed and result.telemetry.compress_tokens_before == prompt_tokens
        assert result.effective_prompt_tokens < prompt_tokens
        assert result.token_ids == alone.token_ids
        assert result.fingerprint["compress"] == "always" and result.fingerprint["compress_drafter_sha256"]
    assert outcomes[1].token_ids == engine.generate(request()).token_ids
    assert not outcomes[1].telemetry.compressed and outcomes[1].fingerprint["compress"] == "off"


def test_a_worker_asking_v4_for_sparse_attention_stops_at_start(served):
    _, folder, _ = served
    with pytest.raises(UnsupportedFeatureError, match="attends sparsely"):
        Engine.load(str(folder), EngineConfig(device="cpu", attention="sparse"))
