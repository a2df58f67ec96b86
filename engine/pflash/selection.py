"""Which chunks of a prompt PFlash keeps: a pure function of token ids and per-token scores.

    kept = select_chunks(ids, token_scores, SelectionParams(keep_ratio=0.1))
    kept.spans  # [(start, end), ...] token ranges, in prompt order

The rule (docs/design.md section 3, PFlash): smooth the per-token scores with an average pool
(kernel 13), average them per chunk, and keep `max(1, chunks x keep_ratio)` chunks, filling the
budget tier by tier (each tier best first, until the budget is spent):
  1. the question: the chunks holding the last 96 tokens (at budget 1, the last chunk),
  2. anchors: where n-grams (2 to 4 tokens) of the question recur in the earlier text, by
     evidence (below; at least `min_anchor_evidence`: one n-gram of rare tokens found once). At
     small budgets (halved chunks, below) each region of matches whole while the budget lasts:
     the chunks holding its matches, then those holding the `anchor_context` (8) tokens each
     side of it. Otherwise the chunks holding matches by their own evidence, then the chunks
     across the edge from a match within `edge_context` (16) tokens of it,
  3. the edges: the first 8 and the last 24 chunks (the question's among them); they take at
     most `max_edge_share` (half) of the budget and only what the anchors left, head and tail
     shrinking by the same factor,
  4. the anchors' neighbours (`anchor_radius` chunks each side), best-scoring first,
  5. the best-scoring rest.
So at small budgets the head and tail reservations shrink before what the question asks about
does: at 8K tokens and keep 0.1 the budget is 25 chunks, less than the 32 edge chunks alone.

Chunks are 32 tokens, or 16 where 32-token chunks would give a budget under `min_budget_chunks`
(16; at keep 0.1, prompts under about 5K tokens): a short fact cut by a chunk edge then costs
two 16-token chunks, not two 32-token ones (at 4K tokens the budget is 12 chunks of 32, three
of them the question's: five facts cut by edges did not fit). The size depends on the prompt's
length and keep ratio only (`chunk_size_for`), so a job's kept chunks never depend on others.

Evidence: a region is a run of question n-gram matches less than `anchor_context` tokens apart;
each distinct n-gram in it adds 1 / (k x m), where k is how often the n-gram occurs in the text
and m how often its rarest token does. A fact's rare phrase (several n-grams found once, of rare
tokens) outranks a stray phrase of common words; n-grams found more than `max_ngram_occurrences`
times are stock phrases and add nothing. A region is one unit whatever the chunk edges: a fact
the question asks about keeps its first words and its answer (often just past the question's
words) together, and the budget is not spent on the far side of edges no fact crosses. Regions
only where chunks are halved: at keep 0.2 on 3.5K-token aclsum papers they cut SmolLM2's
summaries' ROUGE-L against the references from 0.167 to 0.125 (4 papers), spending the budget
on the context of matches a summary does not need (docs/performance.md).

Kept chunks are emitted in prompt order. Nothing here knows about models or devices; the ids
are the drafter's, whose tokens the scores belong to.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SelectionParams:
    keep_ratio: float = 0.1
    chunk_size: int = 32  # tokens per chunk
    # at small budgets chunks halve (down to min_chunk_size) until the budget holds this many:
    # a short fact cut by a chunk edge then costs two small chunks, not two large ones
    min_budget_chunks: int = 16
    min_chunk_size: int = 16
    smoothing_kernel: int = 13  # average-pool width over per-token scores (odd)
    head_chunks: int = 8  # kept from the start (instructions, title) when the budget allows
    tail_chunks: int = 24  # kept from the end (the question and the template's tail) when it allows
    max_edge_share: float = 0.5  # head + tail take at most this share of the budget
    question_tokens: int = 96  # the last tokens: the question, always kept, searched for n-grams
    ngram: int = 4  # the longest question n-gram looked for in the text
    min_ngram: int = 2  # the shortest
    min_anchor_evidence: float = 1.0  # a chunk's evidence to count as an anchor
    anchor_context: int = 8  # tokens kept each side of a run of question matches (a fact's first and last words)
    edge_context: int = 16  # at larger budgets: an n-gram this close to a chunk edge also anchors the next chunk
    anchor_radius: int = 1  # chunks kept on each side of an anchor when the budget allows
    # a question n-gram found more often than this in the text is a stock phrase, not an anchor
    max_ngram_occurrences: int = 8

    def __post_init__(self):
        if not 0.0 < self.keep_ratio <= 1.0:
            raise ValueError(f"keep_ratio must be in (0, 1], got {self.keep_ratio}")
        if not 1 <= self.min_chunk_size <= self.chunk_size or self.smoothing_kernel < 1:
            raise ValueError(f"need 1 <= min_chunk_size <= chunk_size and smoothing_kernel >= 1: {self}")
        if not 2 <= self.min_ngram <= self.ngram:  # one shared token is no evidence
            raise ValueError(f"need 2 <= min_ngram <= ngram, got min_ngram={self.min_ngram}, ngram={self.ngram}")
        if self.smoothing_kernel % 2 == 0:
            raise ValueError(f"smoothing_kernel must be odd (centred window), got {self.smoothing_kernel}")
        if not 0.0 <= self.max_edge_share <= 1.0:
            raise ValueError(f"max_edge_share must be in [0, 1], got {self.max_edge_share}")
        if min(self.head_chunks, self.tail_chunks, self.question_tokens, self.anchor_radius, self.anchor_context) < 0:
            raise ValueError("head_chunks, tail_chunks, question_tokens, anchor_radius and anchor_context must be "
                             f">= 0: {self}")


@dataclass
class Selection:
    kept_chunks: list[int]  # sorted chunk indices
    spans: list[tuple[int, int]]  # merged token ranges [start, end), in order
    num_chunks: int
    budget: int
    head: list[int] = field(default_factory=list)
    tail: list[int] = field(default_factory=list)  # the kept end chunks, the question's included
    anchors: list[int] = field(default_factory=list)  # anchor chunks that were kept
    question: list[int] = field(default_factory=list)  # the question's chunks (all kept)
    chunk_size: int = 32  # tokens per chunk for this prompt (chunk_size_for)

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


def chunk_size_for(num_tokens: int, params: SelectionParams) -> int:
    """`chunk_size`, halved while the budget would hold fewer than `min_budget_chunks` chunks
    (not below `min_chunk_size`): a function of the prompt's length and keep ratio only."""
    size = params.chunk_size
    while size // 2 >= params.min_chunk_size and \
            keep_budget(math.ceil(num_tokens / size), params.keep_ratio) < params.min_budget_chunks:
        size //= 2
    return size


def question_chunks(num_tokens: int, budget: int, params: SelectionParams) -> list[int]:
    """The chunks holding the last `question_tokens` tokens (the last one at least), at most
    `budget` of them, counted from the end."""
    num_chunks = math.ceil(num_tokens / params.chunk_size)
    first = min(num_chunks - 1, max(0, num_tokens - params.question_tokens) // params.chunk_size)
    return list(range(max(first, num_chunks - budget, 0), num_chunks)) if budget > 0 else []


def head_and_tail(num_chunks: int, room: int, head: int, tail: int, min_tail: int = 1) -> tuple[list[int], list[int]]:
    """The edge chunks in `room` chunks: when head + tail exceed it both shrink by the same factor;
    the tail keeps at least `min_tail` chunks (the question's) and gets the rounding."""
    min_tail = min(min_tail, num_chunks)
    room = max(room, min_tail)
    if head + tail > room:
        head = head * room // (head + tail)
        tail = room - head
    tail = max(tail, min_tail)
    head = min(head, room - tail)
    tail_chunks = list(range(max(0, num_chunks - tail), num_chunks))
    head_chunks = [c for c in range(min(head, num_chunks)) if c < num_chunks - tail]
    return head_chunks, tail_chunks


def question_matches(ids: list[int], params: SelectionParams) -> list[tuple[int, int, tuple, float]]:
    """(start, end, n-gram, weight) of every match in the text of a question n-gram (min_ngram..
    ngram tokens; the question is the last `question_tokens` ids), sorted by start. weight =
    1 / (k x m): k, the n-gram's occurrences in the text; m, its rarest token's. N-grams found
    more than `max_ngram_occurrences` times (stock phrases) are left out."""
    q = params.question_tokens
    if q == 0 or len(ids) <= q:
        return []
    question, text_length = ids[-q:], len(ids) - q
    wanted = {n: set(zip(*(question[i:] for i in range(n)))) for n in range(params.min_ngram, params.ngram + 1)}
    positions: dict[tuple, list[int]] = defaultdict(list)  # question n-gram -> its starts in the text
    for i in shared_bigram_starts(ids, text_length, question):  # every shared n-gram starts with one
        for n, grams in wanted.items():
            gram = tuple(ids[i:i + n])
            if i + n <= text_length and gram in grams:
                positions[gram].append(i)
    token_counts = np.bincount(np.asarray(ids[:text_length], dtype=np.int64))
    matches = []
    for gram, starts in positions.items():
        if len(starts) > params.max_ngram_occurrences:
            continue
        weight = 1.0 / (len(starts) * min(int(token_counts[t]) for t in gram))
        matches += [(i, i + len(gram), gram, weight) for i in starts]
    return sorted(matches, key=lambda m: (m[0], m[1]))


def anchor_evidence(ids: list[int], params: SelectionParams) -> tuple[dict[int, float], dict[int, float]]:
    """(chunk -> evidence that it holds what the question asks about, chunk -> evidence next door):
    the sum of the weights of the distinct question n-grams (question_matches) found in the chunk;
    an n-gram within `edge_context` tokens of its chunk's edge gives the chunk across that edge
    half its weight, as evidence next door (the rule at budgets of `min_budget_chunks` or more)."""
    size, context, last_chunk = params.chunk_size, params.edge_context, (len(ids) - 1) // params.chunk_size
    inside: dict[int, dict[tuple, float]] = defaultdict(dict)  # chunk -> n-gram -> weight
    beside: dict[int, dict[tuple, float]] = defaultdict(dict)
    for start, end, gram, weight in question_matches(ids, params):
        first, last = start // size, (end - 1) // size
        for chunk in range(first, last + 1):
            inside[chunk][gram] = weight
        for chunk in {(start - context) // size, (end - 1 + context) // size} - {first, last}:
            if 0 <= chunk <= last_chunk:
                beside[chunk][gram] = weight / 2
    total = lambda grams: {chunk: sum(g.values()) for chunk, g in grams.items()}  # noqa: E731
    return total(inside), total(beside)


@dataclass(frozen=True)
class AnchorRegion:
    """A run of question matches less than `anchor_context` tokens apart, [start, end) tokens."""
    start: int
    end: int
    evidence: float  # the summed weights of the distinct n-grams in it

    def chunks(self, params: SelectionParams, num_tokens: int) -> list[int]:
        """The chunks the region and `anchor_context` tokens each side of it cover, the ones
        holding the matches first (what a region the budget cuts short keeps): a fact cut by a
        chunk edge comes with both halves."""
        size, context = params.chunk_size, params.anchor_context
        matched = range(self.start // size, (self.end - 1) // size + 1)
        around = range(max(0, self.start - context) // size, (min(num_tokens, self.end + context) - 1) // size + 1)
        return list(matched) + [c for c in around if c not in matched]


def anchor_regions(ids: list[int], params: SelectionParams) -> list[AnchorRegion]:
    """The question's matches in the text grouped into regions, best evidence first (ties: the
    earlier region). A fact the question asks about is one region however the chunks cut it."""
    regions: list[tuple[int, int, dict]] = []  # (start, end, n-gram -> weight)
    for start, end, gram, weight in question_matches(ids, params):
        if regions and start - regions[-1][1] < params.anchor_context:
            first, last, grams = regions[-1]
            grams[gram] = weight
            regions[-1] = (first, max(last, end), grams)
        else:
            regions.append((start, end, {gram: weight}))
    out = [AnchorRegion(start, end, sum(grams.values())) for start, end, grams in regions]
    return sorted(out, key=lambda r: (-r.evidence, r.start))


def shared_bigram_starts(ids: list[int], text_length: int, question: list[int]) -> list[int]:
    """Starts i < text_length - 1 of the text's bigrams (ids[i], ids[i + 1]) that the question
    holds too (numpy: a 128K-token prompt is scanned in milliseconds, not a Python loop)."""
    if text_length < 2 or len(question) < 2:
        return []
    text = np.asarray(ids[:text_length], dtype=np.int64)
    asked = np.asarray(question, dtype=np.int64)
    keys = (text[:-1] << 32) | text[1:]  # exact: token ids are below 2**31
    wanted = (asked[:-1] << 32) | asked[1:]
    return np.flatnonzero(np.isin(keys, wanted)).tolist()


def select_chunks(ids: list[int], token_scores: torch.Tensor, params: SelectionParams = SelectionParams()) -> Selection:
    """ids: the scored tokens; token_scores: [len(ids)] one score per token (higher = keep)."""
    if len(ids) != token_scores.numel():
        raise ValueError(f"{len(ids)} ids but {token_scores.numel()} scores")
    if not ids:
        raise ValueError("nothing to select from: the prompt is empty")
    size = chunk_size_for(len(ids), params)
    small_budget = size < params.chunk_size   # chunks were halved: regions (below)
    params = replace(params, chunk_size=size)
    per_chunk = chunk_scores(smooth_scores(token_scores, params.smoothing_kernel), params.chunk_size).tolist()
    num_chunks = len(per_chunk)
    budget = keep_budget(num_chunks, params.keep_ratio)
    kept: set[int] = set()

    def keep(chunks, key=lambda c: (-per_chunk[c], c)) -> list[int]:
        """Adds the best of `chunks` (not yet kept; key None: in the given order) while the
        budget lasts; returns them."""
        fresh = [c for c in dict.fromkeys(chunks) if c not in kept]
        taken = (sorted(fresh, key=key) if key else fresh)[: max(0, budget - len(kept))]
        kept.update(taken)
        return taken

    question = sorted(keep(question_chunks(len(ids), budget, params)))
    anchors = []
    if small_budget:   # every fact whole at the least cost: regions, best evidence first
        for region in anchor_regions(ids, params):
            if region.evidence >= params.min_anchor_evidence:
                anchors += keep(region.chunks(params, len(ids)), key=None)
    else:   # the chunks holding matches by their own evidence, then those across their edges
        for evidence in anchor_evidence(ids, params):
            strong = [c for c, e in evidence.items() if e >= params.min_anchor_evidence]
            anchors += keep(strong, key=lambda c: (-evidence[c], -per_chunk[c], c))
    edge_room = min(max(len(question), int(budget * params.max_edge_share)), budget - len(anchors))
    head, tail = head_and_tail(num_chunks, edge_room, params.head_chunks, params.tail_chunks, len(question))
    keep(head + tail)
    r = params.anchor_radius
    keep({n for c in anchors for n in range(max(0, c - r), min(num_chunks, c + r + 1))})
    keep(range(num_chunks))
    ordered = sorted(kept)
    return Selection(ordered, chunk_spans(ordered, len(ids), params.chunk_size), num_chunks, budget,
                     [c for c in head if c in kept], sorted(set(tail) & kept), sorted(anchors), question,
                     params.chunk_size)


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
