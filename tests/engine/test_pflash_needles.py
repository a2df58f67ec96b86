"""Needles in a real 8K-token paper: five short facts at 2%, 20%, 50%, 80% and 98% depth, a
question about each at the end. At keep ratio 0.1 PFlash (SmolLM2 drafting for itself) keeps
all five, and SmolLM2 answers from the compressed prompt what it answers from the full one.

Each answer is SmolLM2's greedy continuation after "Question: ...", with the assistant turn
opened by the fact's own stem ("Zorblax's favourite fruit is"), asked once after the full
document and once after the compressed one (the document's KV rows are reused across the five
questions). The answers are single common-word tokens (test_pflash_helpers.NEEDLES): from the
full 8K context SmolLM2-135M then finds four of the five (the 2% needle, ~7.5K tokens back, it
answers from another needle); with the old digit-string and rare-name answers it found two.
So: every needle it finds in the full document it also finds, with the same answer, in the
compressed one; it finds at least four in the full one; and all five in the compressed one.
"""
from __future__ import annotations

import functools

import pytest
import torch

from batchd.engine.pflash import compress_for_request
from batchd.engine.runtime import Engine, EngineConfig
from batchd.engine.types import CompressionOptions, GenerationRequest, Telemetry
from tests.engine.test_pflash_helpers import NEEDLE_DEPTHS, NEEDLES, document_with_needles, smollm2_folder

DOCUMENT_TOKENS = 7600  # + the questions: under SmolLM2's 8192-token context with the answers
ANSWER_TOKENS = 8


@torch.inference_mode()
def answers_after(engine: Engine, context_ids: list[int]) -> list[str]:
    """Greedy answer to each needle's question after `context_ids` (prefilled once)."""
    engine.cache.reset()
    engine.runner.prefill(torch.tensor([context_ids]), len(context_ids))  # one causal chunk: fastest on CPU
    context_rows = engine.cache.length
    out = []
    for fact, question, answer in NEEDLES:
        engine.cache.truncate(context_rows)
        stem = fact[: fact.index(answer)].rstrip()
        suffix = f"\n\nQuestion: {question}<|im_end|>\n<|im_start|>assistant\n{stem}"
        logits = engine.runner.prefill(torch.tensor([engine.codec.encode(suffix, add_special_tokens=False)]), 64)
        tokens = []
        for _ in range(ANSWER_TOKENS):
            token = int(logits[0, -1].argmax())
            if token in engine.eos_ids:
                break
            tokens.append(token)
            logits = engine.runner.step(torch.tensor([[token]]))
        out.append(engine.codec.decode(tokens).strip().split("\n")[0])
    return out


@pytest.mark.slow
def test_five_needles_survive_keep_ratio_0_1_and_answers_match():
    engine = Engine.load(str(smollm2_folder()), EngineConfig(max_context=8192))
    codec = engine.codec
    document = document_with_needles(codec, DOCUMENT_TOKENS)
    questions = "\n".join(f"{i + 1}. {question}" for i, (_, question, _) in enumerate(NEEDLES))
    context_ids = codec.encode("<|im_start|>user\n" + document, add_special_tokens=False)
    question_ids = codec.encode(f"\n\nAnswer each question in a few words.\n{questions}<|im_end|>\n"
                                "<|im_start|>assistant\n", add_special_tokens=False)
    prompt_ids = context_ids + question_ids
    assert 7500 < len(prompt_ids) < 8192 - 64

    telemetry = Telemetry()
    request = GenerationRequest(prompt="(ids given)", compression=CompressionOptions(mode="always", keep_ratio=0.1))
    compressed = compress_for_request(engine, prompt_ids, request, telemetry)
    kept = codec.decode(compressed, skip_special_tokens=False)
    for fact, _, _ in NEEDLES:
        assert fact in kept, f"needle lost: {fact}"
    assert len(compressed) <= 0.1 * len(prompt_ids) + 64
    assert compressed[-len(question_ids):] == question_ids  # the questions are in the kept tail

    # the same five questions after the compressed and after the full document
    from_compressed = answers_after(engine, compressed[: -len(question_ids)])
    from_full = answers_after(engine, context_ids)
    print(f"\n{len(prompt_ids)} -> {len(compressed)} tokens, scoring {telemetry.scoring_s:.1f} s")
    for (_, question, answer), c, f in zip(NEEDLES, from_compressed, from_full):
        print(f"{question!r}: compressed {c!r}, full {f!r}")
    for (_, _, answer), c, f in zip(NEEDLES, from_compressed, from_full):
        assert answer in c
        if answer in f:
            assert c == f
    assert sum(answer in f for (_, _, answer), f in zip(NEEDLES, from_full)) >= 4


OTHER_NEEDLES = [  # a second set: other kinds of facts, other wording
    ("The lighthouse keeper of Brisk Island owns a violin made of glass.",
     "What is the violin of the lighthouse keeper of Brisk Island made of?", "glass"),
    ("Captain Ferreira sails only on Tuesdays.",
     "On which day does Captain Ferreira sail?", "Tuesdays"),
    ("The museum of forgotten umbrellas is located in Oslo.",
     "Where is the museum of forgotten umbrellas?", "Oslo"),
    ("Doctor Abernathy's favourite colour is purple.",
     "What is Doctor Abernathy's favourite colour?", "purple"),
    ("The silver bicycle was stolen by a parrot.",
     "Who stole the silver bicycle?", "parrot"),
]


THIRD_NEEDLES = [  # a third set, asked in other words (questions that share little with the fact)
    ("The red tractor on Miller's farm runs on olive oil.",
     "What does the red tractor on Miller's farm run on?", "olive"),
    ("Agent Thornbury hides his spare keys inside a teapot.",
     "Where does Agent Thornbury hide his spare keys?", "teapot"),
    ("The village choir of Little Hexam sings only in Welsh.",
     "In which language does the village choir of Little Hexam sing?", "Welsh"),
    ("Mrs Kowalczyk's cat is afraid of cucumbers.",
     "What is Mrs Kowalczyk's cat afraid of?", "cucumbers"),
    ("The winter festival of Port Saldana ends with a tug of war.",
     "How does the winter festival of Port Saldana end?", "tug"),
]
ASK_IN_A_FEW_WORDS = "Answer each question in a few words.\n{questions}"
ASK_BRIEFLY = "Using the document above, reply briefly to the following:\n{questions}"


@pytest.mark.slow
@pytest.mark.parametrize("tokens, paper, needles, depths, ask", [
    (DOCUMENT_TOKENS, 2, OTHER_NEEDLES, (0.10, 0.25, 0.55, 0.65, 0.90), ASK_IN_A_FEW_WORDS),
    # 4K tokens: a budget of 12 chunks of 32, where facts cut by chunk edges were lost (3 of 5
    # in the first before selection kept question matches whole and used 16-token chunks)
    (4000, None, NEEDLES, NEEDLE_DEPTHS, ASK_IN_A_FEW_WORDS),
    (4000, 0, THIRD_NEEDLES, (0.05, 0.33, 0.41, 0.72, 0.95), ASK_BRIEFLY),
], ids=["paper-2", "4k-first-paper", "4k-paper-0"])
def test_five_needles_in_other_papers_and_depths_survive_keep_ratio_0_1(tokens, paper, needles, depths, ask):
    """Other texts, facts, depths and question wordings, 7.6K- and 4K-token documents: every fact
    is in the kept prompt."""
    from batchd.samples import aclsum_papers

    engine = needle_engine()
    codec = engine.codec
    text = "" if paper is None else [p.text for p in aclsum_papers() if len(p.text.split()) >= 5000][paper]
    document = document_with_needles(codec, tokens, depths=depths, needles=needles, text=text)
    questions = "\n".join(f"{i + 1}. {question}" for i, (_, question, _) in enumerate(needles))
    prompt_ids = codec.encode(f"<|im_start|>user\n{document}\n\n{ask.format(questions=questions)}"
                              "<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    request = GenerationRequest(prompt="(ids given)", compression=CompressionOptions(mode="always", keep_ratio=0.1))
    compressed = compress_for_request(engine, prompt_ids, request, Telemetry())
    kept = codec.decode(compressed, skip_special_tokens=False)
    lost = [fact for fact, _, _ in needles if fact not in kept]
    assert not lost, f"needles lost at keep 0.1 of {len(prompt_ids)} tokens: {lost}"
    assert len(compressed) <= 0.1 * len(prompt_ids) + 32


@functools.cache
def needle_engine() -> Engine:
    return Engine.load(str(smollm2_folder()), EngineConfig(max_context=8192))
