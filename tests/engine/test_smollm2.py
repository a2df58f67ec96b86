"""The real SmolLM2-135M-Instruct GGUF: it loads, answers sensibly, and matches transformers
loading the very same file (its own GGUF reader and dequantisation) token for token."""
from __future__ import annotations

import pytest
import torch

from batchd.engine.runtime import Engine, EngineConfig
from batchd.engine.types import GenerationRequest, SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers needs it to read GGUF

QUESTIONS = ["What is the capital of France?", "Name three primary colours."]


@pytest.fixture(scope="module")
def engine(smollm2_gguf) -> Engine:
    return Engine.load(str(smollm2_gguf), EngineConfig(device="cpu", max_context=2048))


@pytest.fixture(scope="module")
def reference(transformers_smollm2):
    return transformers_smollm2


def chat(question: str, max_new_tokens: int = 24) -> GenerationRequest:
    return GenerationRequest(prompt=question, chat=True, sampling=SamplingParams(max_new_tokens=max_new_tokens))


def test_answers_the_capital_of_france(engine):
    result = engine.generate(chat(QUESTIONS[0], 30))
    assert "Paris" in result.text
    assert result.finish_reason == "eos"


def test_chat_prompt_ids_match_transformers_template(engine, reference):
    _, tokenizer = reference
    for question in QUESTIONS:
        expected = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                 return_dict=False)
        assert engine.codec.encode_request(None, [{"role": "user", "content": question}], True) == list(expected)


def test_prefill_logits_match_transformers(engine, reference, aclsum_sample):
    model, _ = reference
    ids = engine.codec.encode(aclsum_sample[0].text)[:300]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits
        engine.cache.reset()
        got = engine.model(torch.tensor([ids]), engine.cache)
    assert ((got - expected).norm() / expected.norm()).item() < 1e-4


def test_greedy_generation_matches_transformers(engine, reference):
    model, _ = reference
    for question in QUESTIONS:
        ids = engine.codec.encode_request(question, None, True)
        ours = engine.generate_ids(ids, chat(question, 24)).token_ids
        with torch.no_grad():
            theirs = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        eos = engine.eos_ids
        theirs = theirs[: next((i for i, t in enumerate(theirs) if t in eos), len(theirs))]
        assert ours == theirs


def test_a_prefilled_answer_is_continued_not_answered_again(engine):
    """continue_final_message: the prompt ends inside the assistant's message, so the model
    completes that sentence instead of opening a new turn."""
    start = "The capital of France is"
    messages = [{"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": start}]
    ids = engine.codec.encode_request(None, messages, True, continue_final_message=True)
    assert engine.codec.decode(ids, skip_special_tokens=False).endswith(f"<|im_start|>assistant\n{start}")
    result = engine.generate(GenerationRequest(messages=messages, chat=True, continue_final_message=True,
                                               sampling=SamplingParams(max_new_tokens=8)))
    assert result.text.lstrip().startswith("Paris"), result.text
