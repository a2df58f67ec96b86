"""Fused verification: the target scores all q draft tokens in one forward, and decides.

The verify step feeds [last accepted token, d_1 .. d_q] (q + 1 tokens) to the target; lane i sees
the cache rows before its own position, so row i of the logits is the target's next-token
distribution after d_i (row 0: after the last accepted token). Three kinds of output tokens:

- accepted: draft tokens the target keeps, a prefix d_1 .. d_n of the proposal;
- recovered: when d_{n+1} is rejected, the token the target puts in its place (greedy: its own
  argmax; sampling: a draw from norm(max(p_target - p_draft, 0)) at lane n);
- bonus: when all q drafts are accepted, one more token from the target's last row (lane q), which
  costs nothing extra because that row was computed anyway.

Each step therefore yields n + 1 tokens. Sampling uses the rejection rule of Leviathan et al.,
"Fast Inference from Transformers via Speculative Decoding" (arXiv 2211.17192, section 2.3):
accept d_i with probability min(1, p_target(d_i) / p_draft(d_i)); then every output token is
distributed exactly as the target's own sampling would draw it, whatever the drafter proposes.
Prompt lookup has no distribution: its proposal is a one-hot draft (p_draft(d_i) = 1).
Greedy decoding is the temperature -> 0 limit: accept while the draft equals the target's argmax.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from batchd.engine.linear import project
from batchd.engine.sampling import Sampler

# accept_rule(uniforms [q], p_target(d) [q], p_draft(d) [q]) -> accepted [q] bool
AcceptRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Verdict:
    accepted: int  # draft tokens accepted: d_1 .. d_accepted
    tokens: list[int]  # the accepted drafts, then one recovered or bonus token (accepted + 1 ids)


def accept_min_ratio(uniforms: torch.Tensor, p_target: torch.Tensor, p_draft: torch.Tensor) -> torch.Tensor:
    """u < min(1, p_target / p_draft), written without the division; strict, so a token the
    target gives zero probability is never accepted."""
    return uniforms * p_draft < p_target


def accepted_prefix(accepted: torch.Tensor) -> torch.Tensor:
    """accepted: [q] bool -> number of leading True values (0-dim long, on the device)."""
    return accepted.long().cumprod(0).sum()


def verify_greedy(target_tokens: torch.Tensor, draft_tokens: torch.Tensor) -> Verdict:
    """Accept the longest prefix where the draft equals the target's argmax, plus the target's
    token after it. One host sync.

    target_tokens: [q + 1] long, the target's argmax per lane; draft_tokens: [q] long."""
    q = draft_tokens.shape[0]
    n = accepted_prefix(target_tokens[:q] == draft_tokens)
    host = torch.cat([n.view(1), target_tokens]).tolist()
    n = host[0]
    # the accepted drafts equal the target's own tokens at their lanes
    return Verdict(n, host[1 : n + 2])


def certified_argmax(hidden: torch.Tensor, head: nn.Linear) -> torch.Tensor:
    """Per-row argmax of `head(hidden)` exactly as one-row products (decode steps) pick it, for
    the price of one [T, H] x [H, V] GEMM. float32 only.

    The GEMM sums each dot product in another order than a one-row product, so the logits differ
    in the last bits. Any order is within gamma_H * ||h|| * ||w_n|| of the exact value (Higham,
    "Accuracy and Stability of Numerical Algorithms", 2nd ed., eq. 3.5 and Cauchy-Schwarz), so two
    orders differ by at most twice that: a row whose top-2 margin exceeds 4 * gamma_H * ||h|| *
    max_n ||w_n|| has the same argmax either way (and no tie). The other rows are recomputed as
    one-row products, through the very call a decode step makes.

    hidden: [T, H] float32, the final normed hidden states -> [T] long."""
    assert hidden.dtype == head.weight.dtype == torch.float32 and head.bias is None
    logits = F.linear(hidden, head.weight)  # [T, V]
    top2 = logits.topk(2, dim=-1).values.double()
    H = hidden.shape[-1]
    gamma = H * 2.0**-24 / (1 - H * 2.0**-24)
    bound = gamma * hidden.double().norm(dim=-1) * _max_row_norm(head.weight)  # [T]
    tokens = logits.argmax(-1)
    unsure = (top2[:, 0] - top2[:, 1] <= 4 * bound).nonzero().flatten().tolist()
    for row in unsure:
        tokens[row] = project(hidden[None, row : row + 1], head).argmax(-1).view(())
    return tokens


_row_norms: dict[int, tuple] = {}  # id(weight) -> (weakref, (data_ptr, version), max row norm)


def _max_row_norm(weight: torch.Tensor) -> float:
    """max_n ||weight[n]||, cached per tensor and recomputed if the tensor changed."""
    key = (weight.data_ptr(), weight._version)
    cached = _row_norms.get(id(weight))
    if cached is None or cached[0]() is not weight or cached[1] != key:
        cached = (weakref.ref(weight), key, weight.double().norm(dim=-1).max().item())
        _row_norms[id(weight)] = cached
    return cached[2]


def rejection_sample(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: Optional[torch.Tensor],
                     sampler: Sampler, *, accept_rule: AcceptRule = accept_min_ratio) -> Verdict:
    """Speculative sampling (arXiv 2211.17192). One host sync.

    target_probs: [q + 1, V], the target's filtered distributions (Sampler.probabilities);
    draft_tokens: [q] long; draft_probs: [q, V] the distributions the drafts were drawn from, or
    None for one-hot drafts (prompt lookup). `accept_rule` is a parameter only so that tests can
    show that a wrong rule is caught."""
    q, V = draft_tokens.shape[0], target_probs.shape[-1]
    lanes = torch.arange(q, device=target_probs.device)
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(draft_tokens, V).to(target_probs.dtype)
    p_target = target_probs[lanes, draft_tokens]  # [q]
    p_draft = draft_probs[lanes, draft_tokens]  # [q]
    uniforms = sampler.uniform((q,), target_probs.device)
    n = accepted_prefix(accept_rule(uniforms, p_target, p_draft))
    # row n of [residuals of lanes 0..q-1, target row q]: the recovered distribution at a
    # rejected lane, or the bonus distribution when every draft was accepted
    residual = torch.cat([(target_probs[:q] - draft_probs).clamp_min(0), target_probs[q:]])[n]  # [V]
    total = residual.sum()
    # total is 0 only if p_target == p_draft, where a rejection has probability 0; guard anyway
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), target_probs[n])
    extra = sampler.draw(residual)
    host = torch.cat([n.view(1), draft_tokens, extra.view(1)]).tolist()
    n = host[0]
    return Verdict(n, host[1 : 1 + n] + [host[-1]])
