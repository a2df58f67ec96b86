"""How many tokens to draft next, and when to stop speculating for the rest of a job.

Width. Acceptance is modelled as geometric: each draft is accepted with probability alpha given the
ones before it were, so a step of q drafts yields E(q) = 1 + alpha + ... + alpha^q tokens (the
bonus included) and costs C(q) = 1 + c q plain decode steps, c being the drafter's time per token
plus what one more verify lane costs, both relative to a plain step and measured as the job runs.
The width is the q in 1..16 with the most tokens per unit of cost, E(q) / C(q). alpha is the
censored-geometric estimate accepted / (accepted + rejections) over recent steps (exponentially
decayed), starting from a prior.

Switch-off. The policy times plain decode steps (a few at the start of the job, and any step where
the proposer had nothing to offer) and speculative steps (drafting, verification and bookkeeping,
per generated token). Once a window of speculative steps has been timed, if they cost more per
generated token than a plain step does, speculation is off for the rest of the job and the
telemetry says why. Only the adaptive mode switches off: a width the job fixed is honoured.
The loop reads time from the policy's `clock` (wall time; a test passes a virtual one).
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Callable, Optional

from batchd.engine.errors import BadInputError

MAX_WIDTH = 16


def check_width(width: Optional[int]) -> None:
    if width is not None and not 1 <= width <= MAX_WIDTH:
        raise BadInputError(f"--spec-width must be between 1 and {MAX_WIDTH} (or omitted for adaptive), got {width}")


class WidthPolicy:
    def __init__(self, fixed_width: Optional[int] = None, *, prior_acceptance: float = 0.7, prior_weight: float = 1.0,
                 decay: float = 0.7, lane_cost: float = 0.05, calibration_steps: int = 2, window: int = 32,
                 clock: Callable[[], float] = time.perf_counter):
        check_width(fixed_width)
        self.fixed_width = fixed_width
        self.clock = clock  # seconds; what the speculative loop times its steps with
        self.prior_acceptance, self.prior_weight, self.decay = prior_acceptance, prior_weight, decay
        self.lane_cost = lane_cost  # extra verify cost of one more lane, relative to a decode step (measured)
        self.calibration_steps = calibration_steps
        self.accepted_weight = 0.0  # decayed counts of accepted drafts and of rejections
        self.rejected_weight = 0.0
        self.plain_step_s: deque[float] = deque(maxlen=16)
        self.spec_window: deque[tuple[float, int]] = deque(maxlen=window)  # (seconds, tokens) per step
        self.draft_s_per_token: Optional[float] = None
        self.widths_seen: set[int] = set()
        self.disabled_reason: Optional[str] = None

    @property
    def adaptive(self) -> bool:
        return self.fixed_width is None

    @property
    def disabled(self) -> bool:
        return self.disabled_reason is not None

    @property
    def acceptance(self) -> float:
        """Estimated P(a draft is accepted | the drafts before it were)."""
        accepted = self.accepted_weight + self.prior_weight * self.prior_acceptance
        return accepted / (self.accepted_weight + self.rejected_weight + self.prior_weight)

    def width(self) -> int:
        """Drafts to propose next; 0 means a plain decode step."""
        if self.disabled:
            return 0
        if not self.adaptive:
            return self.fixed_width
        if len(self.plain_step_s) < self.calibration_steps:
            return 0  # time a few plain steps first: the switch-off rule compares against them
        # never free: timing noise must not make every lane look like a bargain
        return best_width(self.acceptance, max(0.02, self.lane_cost + self._draft_cost_ratio()))

    def _draft_cost_ratio(self) -> float:
        if self.draft_s_per_token is None or not self.plain_step_s:
            return 0.0
        return self.draft_s_per_token / statistics.median(self.plain_step_s)

    # ---- what happened ---------------------------------------------------------------------

    def record_plain_step(self, seconds: float) -> None:
        self.plain_step_s.append(seconds)

    def record_spec_step(self, offered: int, accepted: int, tokens: int, seconds: float, draft_s: float) -> None:
        """One verify step that offered `offered` drafts, kept `accepted`, yielded `tokens` (after
        stop rules) and took `seconds` in all, `draft_s` of it drafting."""
        self.accepted_weight = self.decay * self.accepted_weight + accepted
        self.rejected_weight = self.decay * self.rejected_weight + (1 if accepted < offered else 0)
        if offered not in self.widths_seen:
            # a width's first step may include one-off work (a CUDA graph capture): not timed
            self.widths_seen.add(offered)
            return
        self.draft_s_per_token = _ema(self.draft_s_per_token, draft_s / offered)
        if self.plain_step_s:  # what one more verify lane costs, relative to a decode step
            plain = statistics.median(self.plain_step_s)
            self.lane_cost = _ema(self.lane_cost, max(0.0, (seconds - draft_s) / plain - 1.0) / offered)
        self.spec_window.append((seconds, tokens))
        if self.adaptive and not self.disabled:
            self.disabled_reason = self._switch_off_reason()

    def _switch_off_reason(self) -> Optional[str]:
        if len(self.spec_window) < self.spec_window.maxlen or not self.plain_step_s:
            return None
        spec = sum(s for s, _ in self.spec_window) / max(1, sum(t for _, t in self.spec_window))
        plain = statistics.median(self.plain_step_s)
        if spec <= plain:
            return None
        return (f"speculation cost {spec * 1e3:.2f} ms per generated token over the last "
                f"{len(self.spec_window)} steps (acceptance {self.acceptance:.2f}), more than plain decode's "
                f"{plain * 1e3:.2f} ms: plain decode for the rest of the job")


def best_width(alpha: float, cost_per_draft: float) -> int:
    """argmax over q in 1..16 of E(q) / C(q): expected tokens of a step of q drafts (geometric
    acceptance alpha, bonus token included) over its cost in plain steps, 1 + cost_per_draft * q."""
    tokens, best, best_rate = 1.0, 1, 0.0
    for q in range(1, MAX_WIDTH + 1):
        tokens += alpha**q
        rate = tokens / (1.0 + cost_per_draft * q)
        if rate > best_rate:
            best, best_rate = q, rate
    return best


def _ema(average: Optional[float], value: float, weight: float = 0.3) -> float:
    return value if average is None else (1 - weight) * average + weight * value
