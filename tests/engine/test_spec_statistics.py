"""Rejection sampling reproduces the target's distribution, and a wrong rule is caught.

A context-free toy: over a 12-token vocabulary the target's next-token distribution at output
position i is p_target[i], the drafter's p_draft[i] (different on purpose). Speculative steps of
q = 3 drafts run until 4 tokens exist; the tokens at each position, over many runs, must follow
p_target[i] (Pearson chi-square, p > 1e-4 per position, 4 positions). This covers accepted,
recovered and bonus tokens at every lane. The same test with a broken acceptance rule or a broken
recovery distribution must fail, or the test proves nothing.
"""
from __future__ import annotations

import pytest
import torch

from batchd.engine.sampling import Sampler
from batchd.engine.speculative.verify import accept_min_ratio, rejection_sample
from batchd.engine.types import SamplingParams

V, POSITIONS, WIDTH, RUNS = 12, 4, 3, 6000


def distributions(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target = torch.rand(POSITIONS + WIDTH, V, generator=g).pow(3)
    target[:, 0] = 0.0  # a token the target never emits: must never come out
    draft = torch.rand(POSITIONS + WIDTH, V, generator=g).pow(3)
    return target / target.sum(-1, keepdim=True), draft / draft.sum(-1, keepdim=True)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of `counts` against `probs`. Categories expected fewer than 5 times are
    pooled (the chi-square approximation needs it); categories of probability 0 must be empty."""
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs.double() * counts.sum()
    rare = expected < 5
    observed = torch.cat([counts[~rare].double(), counts[rare].double().sum().view(1)])
    expected = torch.cat([expected[~rare], expected[rare].sum().view(1)])
    observed, expected = observed[expected > 0], expected[expected > 0]
    stat = ((observed - expected) ** 2 / expected).sum()
    dof = observed.numel() - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2).item()


def sample_outputs(accept_rule, one_hot_drafts: bool, recover_from_target: bool = False, seed: int = 7) -> torch.Tensor:
    """[RUNS, POSITIONS] tokens generated speculatively."""
    target, draft = distributions(seed=1)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed), "cpu")
    out = torch.empty(RUNS, POSITIONS, dtype=torch.long)
    for run in range(RUNS):
        tokens: list[int] = []
        while len(tokens) < POSITIONS:
            pos = len(tokens)
            draft_probs = draft[pos : pos + WIDTH]
            if one_hot_drafts:  # prompt lookup: a fixed proposal, p_draft one-hot
                drafts = draft_probs.argmax(-1)
                draft_probs = None
            else:
                drafts = sampler.draw(draft_probs)
            target_probs = target[pos : pos + WIDTH + 1]
            if recover_from_target:  # broken: resample from p_target instead of the residual
                verdict = rejection_sample(target_probs, drafts, torch.zeros_like(target_probs[:WIDTH]), sampler,
                                           accept_rule=lambda u, pt, pd: accept_rule(u, pt, draft_probs[
                                               torch.arange(WIDTH), drafts]))
            else:
                verdict = rejection_sample(target_probs, drafts, draft_probs, sampler, accept_rule=accept_rule)
            assert len(verdict.tokens) == verdict.accepted + 1
            tokens += verdict.tokens
        out[run] = torch.tensor(tokens[:POSITIONS])
    return out


def worst_p_value(outputs: torch.Tensor) -> float:
    target, _ = distributions(seed=1)
    return min(chi_square_p_value(torch.bincount(outputs[:, i], minlength=V), target[i]) for i in range(POSITIONS))


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft-model", "one-hot-lookup"])
def test_rejection_sampling_keeps_the_target_distribution(one_hot):
    assert worst_p_value(sample_outputs(accept_min_ratio, one_hot)) > 1e-4


def accept_if_more_likely_than_uniform(u, p_target, p_draft):
    return u < p_target  # ignores p_draft: the subtle mistake of treating every draft as one-hot


@pytest.mark.parametrize("broken", ["accept-ignores-draft-prob", "always-accept", "recover-from-target"])
def test_broken_rules_are_detected(broken):
    if broken == "accept-ignores-draft-prob":
        outputs = sample_outputs(accept_if_more_likely_than_uniform, one_hot_drafts=False)
    elif broken == "always-accept":
        outputs = sample_outputs(lambda u, pt, pd: torch.ones_like(u, dtype=torch.bool), one_hot_drafts=False)
    else:
        outputs = sample_outputs(accept_min_ratio, one_hot_drafts=False, recover_from_target=True)
    assert worst_p_value(outputs) < 1e-4
