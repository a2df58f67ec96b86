"""Counters of one job's speculation, and their translation into `Telemetry` fields.

A speculative step is a verify step that offered at least one draft token (a step without a
proposal is a plain decode step and is not counted). Per step the target keeps `accepted` draft
tokens and adds one of its own (the recovered or bonus token), so the mean accepted length
includes the bonus token: it is the number of tokens one verify step yields, between 1 and q + 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from batchd.engine.speculative.adaptive import MAX_WIDTH
from batchd.engine.types import Telemetry


@dataclass
class SpecStats:
    steps: int = 0  # verify steps that offered >= 1 draft token
    offered: int = 0  # draft tokens offered
    accepted: int = 0  # draft tokens accepted
    draft_s: float = 0.0
    verify_s: float = 0.0
    # offered_at[i]: steps that offered a draft at lane i; accepted_at[i]: ... and accepted it
    offered_at: list[int] = field(default_factory=lambda: [0] * MAX_WIDTH)
    accepted_at: list[int] = field(default_factory=lambda: [0] * MAX_WIDTH)

    def record(self, num_offered: int, num_accepted: int) -> None:
        assert 0 <= num_accepted <= num_offered <= MAX_WIDTH
        if num_offered == 0:
            return
        self.steps += 1
        self.offered += num_offered
        self.accepted += num_accepted
        for i in range(num_offered):
            self.offered_at[i] += 1
        for i in range(num_accepted):
            self.accepted_at[i] += 1

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft tokens / offered draft tokens."""
        return self.accepted / self.offered if self.offered else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens per speculative step, the bonus (or recovered) token included."""
        return (self.accepted + self.steps) / self.steps if self.steps else None

    @property
    def acceptance_per_position(self) -> list[float]:
        """P(draft at lane i accepted | lane i offered), for the lanes that were ever offered."""
        return [a / o for a, o in zip(self.accepted_at, self.offered_at) if o]

    def fill(self, telemetry: Telemetry) -> None:
        telemetry.spec_steps = self.steps
        telemetry.spec_draft_tokens_offered = self.offered
        telemetry.spec_draft_tokens_accepted = self.accepted
        telemetry.acceptance_rate = self.acceptance_rate
        telemetry.mean_accepted_length = self.mean_accepted_length
        telemetry.acceptance_per_position = self.acceptance_per_position
        telemetry.draft_s = self.draft_s
        telemetry.verify_s = self.verify_s
