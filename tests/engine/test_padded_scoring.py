"""PFlash's padded one-forward scoring (engine.pflash.scoring.PaddedScorer, CUDA's path, run here
eagerly): the scores of the chunked two-forward path, whatever the padding, and bits that depend
on the prompt alone, not on what was scored before it. SmolLM2's real weights, on the CPU."""
from __future__ import annotations

import random

import pytest
import torch

from batchd.engine.checkpoint import load_checkpoint
from batchd.engine.model import build_model
from batchd.engine.pflash.scoring import PaddedScorer, score_prompt
from tests.engine.test_pflash_helpers import long_paper_text, smollm2_folder


@pytest.fixture(scope="module")
def drafter():
    ckpt = load_checkpoint(str(smollm2_folder()))
    model = build_model(ckpt.config, "cpu", torch.float32, tensors=ckpt.tensors)
    ids = ckpt.tokenizer.encode(long_paper_text(2000)).ids
    return model, ids


@pytest.mark.parametrize("length", [9, 300, 512, 700])
def test_padded_scores_match_the_chunked_path(drafter, length):
    model, ids = drafter
    prompt = ids[:length]
    padded = PaddedScorer(model, bucket=256).score(prompt)
    chunked = score_prompt(model, prompt, prefill_chunk=128, window=None)
    assert padded.shape == (length,)
    torch.testing.assert_close(padded, chunked, rtol=1e-4, atol=1e-6)
    # the tail's own keys and the rows just before it are what the tail attends to most
    assert padded.argmax().item() == chunked.argmax().item()


def test_a_prompts_scores_do_not_depend_on_what_was_scored_before(drafter):
    model, ids = drafter
    scorer = PaddedScorer(model, bucket=256)
    first = scorer.score(ids[:400])
    rng = random.Random(0)
    for _ in range(3):   # other prompts of the same padded length and of others
        scorer.score(ids[rng.randrange(100): rng.randrange(300, 900)])
    assert torch.equal(scorer.score(ids[:400]), first)


def test_a_prompt_that_is_all_tail_is_refused(drafter):
    model, ids = drafter
    with pytest.raises(ValueError, match="all tail"):
        PaddedScorer(model).score(ids[:8])
