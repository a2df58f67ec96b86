"""Proposers: where draft tokens come from. They know nothing of verification.

A proposer sees the job's context (prompt ids + tokens generated so far; the last one is not yet
in the target's cache) and proposes up to `width` next tokens, with the distributions it drew them
from (None: one-hot drafts). After verification it hears how many drafts the target accepted.

- `PromptLookupProposer`: no model. Finds the most recent earlier occurrence of the context's last
  n tokens (n = 6 down to 2, longest first) in the prompt or the output, and proposes the tokens
  that followed it, more of them for a longer match. Strong where the output copies its input:
  summaries, extraction, rewriting.
- `DraftModelProposer`: a small model with the target's vocabulary (a `DraftModel`, with its own
  KV cache and step runner) drafts autoregressively. Its cache follows the accepted tokens: rejected draft
  rows are truncated and the accepted tail is fed at the next proposal.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from batchd.engine.sampling import Sampler


@dataclass
class Proposal:
    tokens: torch.Tensor  # [k] long on the target's device, k <= width (k = 0: nothing to offer)
    probs: Optional[torch.Tensor] = None  # [k, V] the draft distributions, or None for one-hot drafts

    def __len__(self) -> int:
        return self.tokens.shape[0]


class Proposer(Protocol):
    def begin(self, prompt_ids: list[int]) -> None:
        """A new job with this prompt."""

    def propose(self, context: list[int], width: int) -> Proposal:
        """Up to `width` (>= 1) tokens to follow `context` (prompt + output so far)."""

    def accepted(self, num_accepted: int) -> None:
        """The target kept the first `num_accepted` tokens of the last proposal."""


class PromptLookupProposer:
    """n-gram matching over the context. The index maps each n-gram (n = min_n..max_n) to the
    position right after its latest occurrence; it grows with the context, so a lookup is O(1).

    A longer match predicts its continuation better, so a match of n tokens proposes
    max(1, width * n // max_n) tokens; single-token matches (min_n = 2) propose nothing: on
    SmolLM2's aclsum summaries both choices raise tokens per unit of verify cost (bench/speculative.py)."""

    def __init__(self, device, *, min_n: int = 2, max_n: int = 6):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.device, self.min_n, self.max_n = device, min_n, max_n
        self.begin([])

    def begin(self, prompt_ids: list[int]) -> None:
        self.index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(self.min_n, self.max_n + 1)}
        self.indexed = 0  # context[:indexed] is in the index

    def _extend_index(self, context: list[int]) -> None:
        # register the n-grams that end just before position j (their follower is context[j]);
        # the context's own final n-gram has no follower yet, so it never matches itself
        for j in range(max(self.indexed, 1), len(context)):
            for n in range(self.min_n, min(self.max_n, j) + 1):
                self.index[n][tuple(context[j - n : j])] = j
        self.indexed = len(context)

    def propose(self, context: list[int], width: int) -> Proposal:
        self._extend_index(context)
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            follower = self.index[n].get(tuple(context[-n:]))
            if follower is not None:
                return self._proposal(context[follower : follower + max(1, width * n // self.max_n)])
        return self._proposal([])

    def _proposal(self, tokens: list[int]) -> Proposal:
        return Proposal(torch.tensor(tokens, dtype=torch.long, device=self.device))

    def accepted(self, num_accepted: int) -> None:
        pass


class DraftModelProposer:
    """Autoregressive drafting by a small model. Invariant between calls: the drafter's cache
    holds rows for a prefix of the context (`cache.length` tokens of it)."""

    def __init__(self, drafter, sampler: Sampler):
        self.drafter = drafter  # drafters.DraftModel (or an Engine): model, cache, runner, prefill_chunk
        self.sampler = sampler
        self.fed_drafts = 0  # draft tokens of the last proposal written to the drafter's cache
        self.context_rows = 0  # rows of the context in the drafter's cache before that proposal

    @property
    def cache(self):
        return self.drafter.cache

    def begin(self, prompt_ids: list[int]) -> None:
        # the same chunks as the target's prefill, so a drafter that is the target itself
        # computes the very same rows (its acceptance is then exactly 1)
        self.cache.reset()
        tokens = torch.tensor([prompt_ids], dtype=torch.long, device=self.cache.device)
        self.drafter.runner.prefill(tokens, self.drafter.prefill_chunk)
        self.fed_drafts = 0
        self.context_rows = self.cache.length

    def propose(self, context: list[int], width: int) -> Proposal:
        # the context tokens the drafter has not seen: the accepted tail and the newest token
        logits = self._feed(context[self.cache.length :])  # [V], after the context's last token
        width = min(width, self.cache.max_len - self.cache.length + 1)
        self.context_rows = self.cache.length
        tokens, probs = [], []
        for i in range(width):
            if self.sampler.greedy:
                token = logits.argmax(-1, keepdim=True)  # [1]
            else:
                p = self.sampler.probabilities(logits)
                token = self.sampler.draw(p).view(1)
                probs.append(p)
            tokens.append(token)
            if i + 1 < width:  # the last draft is fed only if it is accepted
                logits = self.drafter.runner.step(token.view(1, 1))[0, -1]
        self.fed_drafts = max(0, width - 1)
        return Proposal(torch.cat(tokens), torch.stack(probs) if probs else None)

    def accepted(self, num_accepted: int) -> None:
        # keep the rows of accepted drafts; the next proposal feeds what follows them
        self.cache.truncate(self.context_rows + min(num_accepted, self.fed_drafts))
        self.fed_drafts = 0

    def _feed(self, new_tokens: list[int]) -> torch.Tensor:
        """Append `new_tokens` (>= 1) to the drafter's cache -> logits of the last one [V]."""
        tokens = torch.tensor([new_tokens], dtype=torch.long, device=self.cache.device)
        if len(new_tokens) <= MAX_STEP_ROWS:
            return self.drafter.runner.step(tokens)[0, -1]
        return self.drafter.runner.prefill(tokens, self.drafter.prefill_chunk)[0, -1]


MAX_STEP_ROWS = 16  # a catch-up this long runs as one (graph-replayed) step; longer ones as prefill
