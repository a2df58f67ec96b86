"""Which chunks of a prompt PFlash keeps: a pure function of token ids and per-token scores.

    kept = select_chunks(ids, token_scores, SelectionParams(keep_ratio=0.1))
    kept.spans  # [(start, end), ...] token ranges, in prompt order

The rule (docs/design.md section 3, PFlash): smooth the per-token scores with an average pool
(kernel 13), average them per 32-token chunk, and keep `max(1, chunks x keep_ratio)` chunks:
  1. the first 8 and the last 24 chunks; when they would take more than `max_edge_share` (half)
     of the budget, both shrink by the same factor ("scaled down to fit": at 8K tokens and keep
     0.1 the budget is 25 chunks, and edges that took all of it would leave nothing to select),
  2. the chunks holding a 4-gram that the question (the last 96 tokens) shares with the earlier
     text, then their neighbours (`anchor_radius` chunks each side), best-scoring first in each tier,
  3. then the best-scoring rest.
Kept chunks are emitted in prompt order. Nothing here knows about models or devices; the ids
are the drafter's, whose tokens the scores belong to.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SelectionParams:
    keep_ratio: float = 0.1
    chunk_size: int = 32  # tokens per chunk
    smoothing_kernel: int = 13  # average-pool width over per-token scores (odd)
    head_chunks: int = 8  # always kept from the start (instructions, title)
    tail_chunks: int = 24  # always kept from the end (the question and the template's tail)
    max_edge_share: float = 0.5  # head + tail take at most this share of the budget
    question_tokens: int = 96  # the last tokens taken as the question for n-gram anchors
    ngram: int = 4
    anchor_radius: int = 1  # chunks kept on each side of a chunk holding a question n-gram
    # a question n-gram found more often than this in the text is a stock phrase, not an anchor
    max_ngram_occurrences: int = 8

    def __post_init__(self):
        if not 0.0 < self.keep_ratio <= 1.0:
            raise ValueError(f"keep_ratio must be in (0, 1], got {self.keep_ratio}")
        if self.chunk_size < 1 or self.ngram < 1 or self.smoothing_kernel < 1:
            raise ValueError(f"chunk_size, ngram and smoothing_kernel must be >= 1: {self}")
        if self.smoothing_kernel % 2 == 0:
            raise ValueError(f"smoothing_kernel must be odd (centred window), got {self.smoothing_kernel}")
        if not 0.0 <= self.max_edge_share <= 1.0:
            raise ValueError(f"max_edge_share must be in [0, 1], got {self.max_edge_share}")
        if min(self.head_chunks, self.tail_chunks, self.question_tokens, self.anchor_radius) < 0:
            raise ValueError(f"head_chunks, tail_chunks, question_tokens and anchor_radius must be >= 0: {self}")


@dataclass
class Selection:
    kept_chunks: list[int]  # sorted chunk indices
    spans: list[tuple[int, int]]  # merged token ranges [start, end), in order
    num_chunks: int
    budget: int
    head: list[int] = field(default_factory=list)
    tail: list[int] = field(default_factory=list)
    anchors: list[int] = field(default_factory=list)  # anchor chunks that were kept

    @property
    def kept_tokens(self) -> int:
        return sum(end - start for start, end in self.spans)

    def take(self, ids: list[int]) -> list[int]:
        return [t for start, end in self.spans for t in ids[start:end]]


def smooth_scores(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """scores [S] -> [S]: centred moving average; windows are cut at the ends, not zero-padded."""
    if kernel <= 1 or scores.numel() == 0:
        return scores.float()
    x = scores.float().view(1, 1, -1)
    return F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2, count_include_pad=False).view(-1)


def chunk_scores(token_scores: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """token_scores [S] -> [ceil(S / chunk_size)]: the mean score of each chunk."""
    S = token_scores.numel()
    n = math.ceil(S / chunk_size)
    padded = F.pad(token_scores.float(), (0, n * chunk_size - S))
    counts = torch.full((n,), float(chunk_size), device=token_scores.device)
    counts[-1] = S - (n - 1) * chunk_size
    return padded.view(n, chunk_size).sum(-1) / counts


def keep_budget(num_chunks: int, keep_ratio: float) -> int:
    return min(num_chunks, max(1, int(num_chunks * keep_ratio)))


def head_and_tail(num_chunks: int, budget: int, head: int, tail: int,
                  max_edge_share: float = 1.0) -> tuple[list[int], list[int]]:
    """The always-kept chunks; when head + tail exceed `max_edge_share` of the budget both shrink
    by the same factor (the tail gets the rounding, since it holds the question; at least one
    chunk stays)."""
    room = max(1, int(budget * max_edge_share))
    if head + tail > room:
        head = head * room // (head + tail)
        tail = room - head
    head_chunks = list(range(min(head, num_chunks)))
    tail_chunks = [c for c in range(max(0, num_chunks - tail), num_chunks) if c >= len(head_chunks)]
    return head_chunks, tail_chunks


def question_anchor_chunks(ids: list[int], params: SelectionParams) -> tuple[set[int], set[int]]:
    """(chunks holding a question n-gram in the text before the question, their neighbours)."""
    q, n = params.question_tokens, params.ngram
    if q == 0 or len(ids) <= q:
        return set(), set()
    question, text = ids[-q:], ids[:-q]
    wanted = set(zip(*(question[i:] for i in range(n))))
    positions: dict[tuple, list[int]] = defaultdict(list)
    for i, gram in enumerate(zip(*(text[j:] for j in range(n)))):
        if gram in wanted:
            positions[gram].append(i)
    num_chunks = math.ceil(len(ids) / params.chunk_size)
    matches: set[int] = set()
    neighbours: set[int] = set()
    for starts in positions.values():
        if len(starts) > params.max_ngram_occurrences:
            continue
        for i in starts:
            first, last = i // params.chunk_size, (i + n - 1) // params.chunk_size
            matches.update(range(first, last + 1))
            lo, hi = max(0, first - params.anchor_radius), min(num_chunks - 1, last + params.anchor_radius)
            neighbours.update(range(lo, hi + 1))
    return matches, neighbours - matches


def select_chunks(ids: list[int], token_scores: torch.Tensor, params: SelectionParams = SelectionParams()) -> Selection:
    """ids: the scored tokens; token_scores: [len(ids)] one score per token (higher = keep)."""
    if len(ids) != token_scores.numel():
        raise ValueError(f"{len(ids)} ids but {token_scores.numel()} scores")
    if not ids:
        raise ValueError("nothing to select from: the prompt is empty")
    per_chunk = chunk_scores(smooth_scores(token_scores, params.smoothing_kernel), params.chunk_size).tolist()
    num_chunks = len(per_chunk)
    budget = keep_budget(num_chunks, params.keep_ratio)
    head, tail = head_and_tail(num_chunks, budget, params.head_chunks, params.tail_chunks, params.max_edge_share)
    kept = set(head) | set(tail)

    def by_score(chunks):
        return sorted(chunks - kept, key=lambda c: (-per_chunk[c], c))

    matches, neighbours = question_anchor_chunks(ids, params)
    anchors = []
    for tier in (matches, neighbours):
        for c in by_score(tier)[: max(0, budget - len(kept))]:
            kept.add(c)
            anchors.append(c)
    kept.update(by_score(set(range(num_chunks)))[: max(0, budget - len(kept))])
    ordered = sorted(kept)
    return Selection(ordered, chunk_spans(ordered, len(ids), params.chunk_size), num_chunks, budget,
                     head, tail, sorted(anchors))


def chunk_spans(chunks: list[int], num_tokens: int, chunk_size: int) -> list[tuple[int, int]]:
    """Sorted chunk indices -> merged token ranges [start, end)."""
    spans: list[tuple[int, int]] = []
    for c in chunks:
        start, end = c * chunk_size, min(num_tokens, (c + 1) * chunk_size)
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    return spans
