"""One request's state inside the batch engine.

A sequence moves waiting -> running -> finished (or back to waiting when preempted). Its tokens
are the prompt then what it generated; `computed` counts the positions whose keys and values are
in the pool. While computed < len(prompt) it is prefilling (whole chunks at fixed offsets); after
a preemption it replays its generated tokens as decode rows (`replaying`); then every step feeds
its last token (and any drafts) and samples the next.

A decode step launched ahead (engine.batch.batch_engine, "Launching ahead") appends a
PENDING_TOKEN placeholder to `generated` and counts it in `pending` until its id is read back, so
positions and lengths stay exact while the token's value is still on the device.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

from batchd.engine.sampling import Sampler
from batchd.engine.stopping import StopChecker
from batchd.engine.types import GenerationRequest

PENDING_TOKEN = -1   # a generated token computed on the device, not read back yet


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    request: GenerationRequest
    prompt_ids: list[int]
    sampler: Sampler
    stopper: StopChecker
    generated: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    blocks: list[int] = field(default_factory=list)     # the block table, in position order
    computed: int = 0                                     # positions with keys and values in the pool
    shared_chunks: int = 0                                # leading prompt chunks taken from the prefix cache
    registered_chunks: int = 0                            # prompt chunks offered to the prefix cache
    pending: int = 0                                      # trailing PENDING_TOKENs in `generated`
    finish_reason: Optional[str] = None
    cancelled: bool = False
    preemptions: int = 0
    # speculation (prompt lookup): drafts offered / accepted, per lane
    spec_steps: int = 0
    spec_offered: int = 0
    spec_accepted: int = 0
    spec_accepted_at: list[int] = field(default_factory=list)
    spec_offered_at: list[int] = field(default_factory=list)
    spec_alpha: float = 0.7                               # its acceptance estimate (the prior first)
    # wall-clock marks (time.perf_counter) and batch sizes seen while running
    arrived_at: float = field(default_factory=time.perf_counter)
    first_scheduled_at: Optional[float] = None
    prompt_done_at: Optional[float] = None
    finished_at: Optional[float] = None
    batch_sizes: list[int] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    def token(self, position: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[position] if position < n else self.generated[position - n]

    def tokens(self) -> list[int]:
        return self.prompt_ids + self.generated

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_len

    @property
    def replaying(self) -> bool:
        """Generated tokens whose rows a preemption dropped, all but the last (the next input)."""
        return not self.prefilling and self.computed < self.num_tokens - 1

    @property
    def out_of_budget(self) -> bool:
        """Every token it may generate is computed (the last ones may be pending): no more rows."""
        return len(self.generated) >= self.request.sampling.max_new_tokens

    @property
    def decoding(self) -> bool:
        return self.status is SequenceStatus.RUNNING and self.computed == self.num_tokens - 1 and self.generated

    def record_speculation(self, offered: int, accepted: int) -> None:
        """One verify step's drafts: counts per step and per lane, and a moving estimate of
        P(a draft is accepted | the ones before it were) over recent steps."""
        rate = accepted / (accepted + (accepted < offered)) if accepted else 0.0
        self.spec_alpha = 0.7 * self.spec_alpha + 0.3 * rate
        self.spec_steps += 1
        self.spec_offered += offered
        self.spec_accepted += accepted
        while len(self.spec_offered_at) < offered:
            self.spec_offered_at.append(0), self.spec_accepted_at.append(0)
        for lane in range(offered):
            self.spec_offered_at[lane] += 1
            self.spec_accepted_at[lane] += lane < accepted
