"""PFlash selection and scoring without a real model: the rule of docs/design.md section 3 exactly."""
from __future__ import annotations

import math

import pytest
import torch

from batchd.engine.pflash.scoring import score_prompt, score_tail_queries_torch
from batchd.engine.pflash.selection import (
    SelectionParams,
    anchor_evidence,
    chunk_scores,
    chunk_size_for,
    head_and_tail,
    keep_budget,
    select_chunks,
    smooth_scores,
)
from tests.engine.tiny_models import hf_model, ours_from_hf


def random_ids(n: int, seed: int = 0, vocab: int = 5000) -> list[int]:
    return torch.randint(100, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("num_tokens", [32, 1000, 8192, 131072])
@pytest.mark.parametrize("keep_ratio", [0.05, 0.1, 0.5, 1.0])
def test_keeps_the_budget_within_one_chunk(num_tokens, keep_ratio):
    ids = random_ids(num_tokens)
    scores = torch.rand(num_tokens, generator=torch.Generator().manual_seed(1))
    sel = select_chunks(ids, scores, SelectionParams(keep_ratio=keep_ratio))
    size = sel.chunk_size  # 32, or 16 where 32-token chunks would give a budget under 16 chunks
    chunks = math.ceil(num_tokens / size)
    assert sel.num_chunks == chunks and len(sel.kept_chunks) == max(1, int(chunks * keep_ratio))
    # whole chunks: within one chunk of the fraction; only the prompt's last chunk may be partial
    assert abs(len(sel.kept_chunks) * size - keep_ratio * num_tokens) <= size
    assert sel.kept_tokens > (len(sel.kept_chunks) - 1) * size
    assert sel.kept_chunks == sorted(set(sel.kept_chunks))


def test_head_and_tail_always_kept_when_they_fit():
    ids = random_ids(131072)
    scores = torch.zeros(131072)
    scores[50_000:60_000] = 1.0  # the best-scoring chunks are in the middle
    sel = select_chunks(ids, scores, SelectionParams(keep_ratio=0.1))
    assert sel.kept_chunks[:8] == list(range(8))
    assert sel.kept_chunks[-24:] == list(range(4096 - 24, 4096))
    middle = set(range(50_000 // 32, 60_000 // 32))
    assert middle <= set(sel.kept_chunks)  # the rest of the budget went to the best scores


def test_head_and_tail_scale_down_together_to_fit():
    assert head_and_tail(1000, 400, 8, 24) == (list(range(8)), list(range(976, 1000)))
    head, tail = head_and_tail(256, 12, 8, 24, min_tail=4)  # 8K tokens at keep 0.1: half the budget
    assert (len(head), len(tail)) == (3, 9)
    assert head_and_tail(40, 1, 8, 24) == ([], [39])  # the question's chunk outlives the head
    head, tail = head_and_tail(128, 4, 8, 24, min_tail=4)  # the question's chunks fill the room
    assert (head, tail) == ([], [124, 125, 126, 127])


def fact_tokens(k: int, length: int = 6) -> list[int]:
    """A phrase no random_ids text holds (ids above its vocabulary)."""
    return [8000 + 10 * k + j for j in range(length)]


def test_question_ngrams_anchor_their_chunks_and_neighbours():
    ids = random_ids(4096, seed=3)
    fact = [7001, 7002, 7003, 7004, 7005]
    ids[1000:1005] = fact  # chunk 31
    ids[-40:-35] = fact  # inside the last 96 tokens: the question repeats it
    inside, _ = anchor_evidence(ids, SelectionParams())
    assert max(inside, key=inside.get) == 31
    sel = select_chunks(ids, torch.zeros(4096), SelectionParams(keep_ratio=0.1))
    c = 1000 // sel.chunk_size
    assert {c - 1, c, c + 1} <= set(sel.kept_chunks) and c in sel.anchors


def test_stock_phrases_are_not_anchors():
    ids = random_ids(4096, seed=4)
    phrase = [9001, 9002, 9003, 9004]
    for start in range(100, 3000, 200):  # 15 times in the text: a stock phrase
        ids[start:start + 4] = phrase
    ids[-20:-16] = phrase
    inside, _ = anchor_evidence(ids, SelectionParams(max_ngram_occurrences=8))
    assert not any(start // 32 in inside for start in range(100, 3000, 200))


def test_question_matches_outrank_head_and_tail_at_small_budgets():
    """4K tokens at keep 0.1: a budget of 12 chunks, less than the 8 + 24 edge chunks. The
    question's 3 chunks and the 9 chunks holding what it asks about take all of it; the head,
    though it scores best, and the rest of the tail give way (before this rule, the edges took
    half the budget and 6 of the 9 facts were kept)."""
    ids = random_ids(4096, seed=9)
    facts_at = [330 + 416 * k for k in range(9)]  # 10 tokens into a chunk, away from its edges
    question = []
    for k, at in enumerate(facts_at):
        ids[at:at + 6] = fact_tokens(k)
        question += fact_tokens(k)
    ids[-len(question) - 8:-8] = question  # 54 tokens inside the last 96
    scores = torch.zeros(4096)
    scores[:256] = 1.0  # the head scores best
    sel = select_chunks(ids, scores, SelectionParams(keep_ratio=0.1, min_budget_chunks=1))  # 32-token chunks
    assert sel.budget == 12 and len(sel.kept_chunks) == 12
    assert sel.question == [125, 126, 127]  # the last 96 tokens
    assert sel.kept_chunks == [at // 32 for at in facts_at] + sel.question
    assert sel.head == [] and sel.tail == sel.question
    wide = select_chunks(ids, scores, SelectionParams(keep_ratio=0.5))  # room again: the edges come back
    assert wide.head == list(range(8)) and len(wide.tail) == 24


def test_rare_phrases_outrank_stray_matches():
    """A chunk holding a phrase of the question found once outranks chunks holding a bit of the
    question found a few times (a stray phrase), whatever the drafter's scores say."""
    ids = random_ids(4096, seed=10)
    stray = [6001, 6002]
    for start in (500, 1500, 2500):  # the question's last two tokens, three times in the text
        ids[start:start + 2] = stray
    ids[2000:2006] = fact_tokens(0)
    ids[-20:-14] = fact_tokens(0)
    ids[-8:-6] = stray
    inside, _ = anchor_evidence(ids, SelectionParams())
    assert inside[2000 // 32] > 5 * max(inside[s // 32] for s in (500, 1500, 2500))
    scores = torch.zeros(4096)
    for start in (500, 1500, 2500):
        scores[start:start + 32] = 1.0
    sel = select_chunks(ids, scores, SelectionParams(keep_ratio=0.1, question_tokens=32))
    size = sel.chunk_size
    assert 2000 // size in sel.anchors and not any(start // size in sel.anchors for start in (500, 1500, 2500))


def test_a_fact_cut_by_a_chunk_boundary_keeps_its_other_half():
    """The question's words end a chunk; the rest of the fact (the answer, which the question does
    not hold) opens the next one: that chunk is kept too, before the edges."""
    ids = random_ids(4096, seed=11)
    ids[1018:1024] = fact_tokens(0)  # the end of chunk 31; 1024.. (chunk 32) holds the answer
    ids[-30:-24] = fact_tokens(0)
    fixed = dict(keep_ratio=0.05, anchor_radius=0, min_budget_chunks=1)  # 32-token chunks
    sel = select_chunks(ids, torch.zeros(4096), SelectionParams(**fixed))
    assert {31, 32} <= set(sel.anchors)
    far = select_chunks(ids, torch.zeros(4096), SelectionParams(**fixed, edge_context=0))
    assert 31 in far.anchors and 32 not in far.kept_chunks


def test_small_budgets_use_finer_chunks():
    """32-token chunks unless the budget would hold fewer than 16 of them; then 16-token ones."""
    params = SelectionParams(keep_ratio=0.1)
    assert chunk_size_for(8192, params) == 32  # 25 chunks of 32
    assert chunk_size_for(4096, params) == 16  # 12 chunks of 32 -> 25 of 16
    assert chunk_size_for(1000, SelectionParams(keep_ratio=0.05)) == 16  # never below min_chunk_size
    assert chunk_size_for(4096, SelectionParams(keep_ratio=0.1, min_budget_chunks=1)) == 32


def test_facts_cut_by_chunk_edges_are_kept_whole_at_keep_0_1():
    """4K tokens at keep 0.1, five 6-token facts each straddling a chunk edge (of 16 and of 32
    tokens), the question repeating them: every fact's tokens are kept. With 32-token chunks and
    a 12-chunk budget they could not be (3 question chunks + 2 per fact)."""
    ids = random_ids(4096, seed=13)
    facts_at = [29 + 736 * k + 32 * 3 for k in range(5)]  # 3 tokens before a 32-token edge
    question = []
    for k, at in enumerate(facts_at):
        ids[at:at + 6] = fact_tokens(k)
        question += fact_tokens(k)
    ids[-len(question) - 8:-8] = question
    scores = torch.rand(4096, generator=torch.Generator().manual_seed(14))
    sel = select_chunks(ids, scores, SelectionParams(keep_ratio=0.1))
    kept = {t for start, end in sel.spans for t in range(start, end)}
    assert sel.chunk_size == 16 and len(sel.kept_chunks) == sel.budget
    for at in facts_at:
        assert set(range(at - 2, at + 8)) <= kept, f"fact at token {at} cut"


@pytest.mark.parametrize("keep_ratio, kept", [(0.008, [127]), (0.016, [126, 127]), (0.05, [125, 126, 127])])
def test_the_question_is_kept_at_every_budget(keep_ratio, kept):
    ids = random_ids(4096, seed=12)
    scores = torch.zeros(4096)
    scores[:2000] = 1.0
    sel = select_chunks(ids, scores, SelectionParams(keep_ratio=keep_ratio, min_budget_chunks=1))  # 32-token chunks
    assert sel.question == kept and set(kept) <= set(sel.kept_chunks)


def test_anchor_matches_come_before_neighbours_when_the_budget_is_short():
    ids = random_ids(8192, seed=5)
    facts = [[8000 + 10 * k + j for j in range(6)] for k in range(5)]
    question = []
    for k, depth in enumerate((0.2, 0.35, 0.5, 0.65, 0.8)):
        at = int(depth * 8192)
        ids[at:at + 6] = facts[k]
        question += facts[k]
    ids[-len(question) - 10:-10] = question
    scores = torch.rand(8192, generator=torch.Generator().manual_seed(6))
    sel = select_chunks(ids, scores, SelectionParams(keep_ratio=0.1))
    for k, depth in enumerate((0.2, 0.35, 0.5, 0.65, 0.8)):
        assert int(depth * 8192) // 32 in sel.kept_chunks
    assert sel.take(ids) == [t for s, e in sel.spans for t in ids[s:e]]


def test_smoothing_and_chunk_means():
    x = torch.zeros(100)
    x[50] = 13.0
    smooth = smooth_scores(x, 13)
    assert torch.allclose(smooth[44:57], torch.ones(13)) and smooth[43] == 0 and smooth[57] == 0
    edge = smooth_scores(torch.ones(20), 13)
    assert torch.allclose(edge, torch.ones(20))  # windows cut at the ends, not zero-padded
    assert chunk_scores(torch.arange(70.0), 32).tolist() == [15.5, 47.5, 66.5]
    assert keep_budget(3, 0.1) == 1 and keep_budget(256, 0.1) == 25


@pytest.mark.parametrize("bad", [dict(keep_ratio=0.0), dict(keep_ratio=1.5), dict(smoothing_kernel=12),
                                 dict(chunk_size=0), dict(max_edge_share=2.0),
                                 dict(min_ngram=1), dict(min_ngram=5)])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        SelectionParams(**bad)


def test_tail_scores_match_dense_attention():
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(8, 8, 16, generator=g), torch.randn(2, 300, 16, generator=g)
    got = score_tail_queries_torch(q, k)
    kk = k.repeat_interleave(4, dim=0)  # [8, 300, 16]
    logits = q @ kk.transpose(1, 2) / 4.0
    rows = torch.arange(8)[:, None] + 292
    logits = logits.masked_fill(torch.arange(300)[None, :] > rows, float("-inf"))
    expected = logits.softmax(-1).mean(1).amax(0)
    torch.testing.assert_close(got, expected)


def test_score_prompt_matches_transformers_attention():
    """Chunked drafter prefill + tail observer == max over layers and heads of the mean of the
    last 8 rows of the full attention matrices transformers returns."""
    hf = hf_model("llama")
    hf.config._attn_implementation = "eager"
    ours = ours_from_hf(hf)
    ids = random_ids(100, seed=8, vocab=512)
    with torch.no_grad():
        attentions = hf(torch.tensor([ids]), output_attentions=True).attentions  # per layer [1, H, S, S]
    expected = torch.stack([a[0, :, -8:, :].mean(1).amax(0) for a in attentions]).amax(0)
    got = score_prompt(ours, ids, prefill_chunk=37)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
