"""Speculative decoding with fused verification (docs/design.md section 3, third bullet).

A proposer drafts up to q tokens (prompt lookup, or a draft model with the target's vocabulary);
the target checks all of them in ONE forward; greedy keeps the longest prefix that matches its own
argmax plus its next token, sampling uses rejection sampling so the output keeps the target's
distribution (arXiv 2211.17192). The width adapts to recent acceptance, and speculation switches
itself off for a job when it costs more per token than plain decoding.

    generate_speculative(engine, prompt_ids, sampler, stopper, options, telemetry) -> TokenOutput

Modules: proposers (where drafts come from), drafters (loading and building draft models),
verify (the decision), adaptive (width and switch-off), stats (telemetry counters),
decode (the loop).
"""
from batchd.engine.speculative.adaptive import MAX_WIDTH, WidthPolicy
from batchd.engine.speculative.decode import generate_speculative, verify_step
from batchd.engine.speculative.drafters import DraftModel, Drafters, DraftTarget, self_drafter, truncated_drafter
from batchd.engine.speculative.proposers import DraftModelProposer, PromptLookupProposer, Proposal
from batchd.engine.speculative.stats import SpecStats
from batchd.engine.speculative.verify import Verdict, rejection_sample, verify_greedy

__all__ = [
    "MAX_WIDTH", "WidthPolicy", "generate_speculative", "verify_step", "DraftModel", "Drafters", "DraftTarget",
    "self_drafter", "truncated_drafter", "DraftModelProposer", "PromptLookupProposer", "Proposal", "SpecStats",
    "Verdict", "rejection_sample", "verify_greedy",
]
