"""A finer handoff than griddepcontrol.wait between two launches of a decode step.

Under programmatic dependent launch a kernel's griddepcontrol.wait returns once the whole kernel
before it has completed and flushed its memory. After the cluster attention kernel that took
0.4-0.9 us past its last CTA's end (bench/timeline.py, o's "first wait"), and a what-if o that
never waits read 970 tok/s against 948 (kernels/small_matmul/NOTES.md, "Stop 30"). With a handoff
the producer's CTAs each add 1 to a counter once their outputs are stored (a release), and the
consumer's programs spin on it (an acquire) instead of waiting for the grid. The consumer's last
program sets the counter back to zero, so it is zero between steps and the same captured graph can
replay.

    handoff = ReadyHandoff(cache.ready[layer])   # [2] int32, zero
    attn = decode_attention(..., handoff=handoff)   # the cluster kernel arms it (producers += CTAs)
    out = small_linear(attn, o_weight, ..., handoff=handoff)   # consumes it, or clears it

Only a producer that armed it counts: a route that did not (Triton's split and merge, the sparse
path) leaves `producers` at 0 and the consumer waits as before. A consumer route that cannot spin
(the stream kernels) waits as before and clears the counter with a memset.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch


def handoff_enabled() -> bool:
    """BATCHD_ATTENTION_HANDOFF=1 turns the attention -> o handoff on (bench/step_sweep.py). Off by
    default: as built (each o program polls with a scalar atomic), whole steps read 914 tok/s with it
    against 945 without (NOTES "Stop 30"); the bound is 970, so a cheaper poll may still win."""
    value = os.environ.get("BATCHD_ATTENTION_HANDOFF", "0")
    if value not in ("0", "1"):
        raise ValueError(f"BATCHD_ATTENTION_HANDOFF is 0 or 1, got {value!r}")
    return value == "1"


@dataclass
class ReadyHandoff:
    counter: torch.Tensor    # [2] int32 on the device: producer CTAs done, consumer programs done; zero between steps
    producers: int = 0       # producer CTAs armed so far in this step (0: the consumer waits as usual)

    def arm(self, ctas: int) -> int:
        """Called by a producer launch of `ctas` CTAs that will each add 1: the counter's address."""
        self.producers += ctas
        return self.counter.data_ptr()

    @property
    def armed(self) -> bool:
        return self.producers > 0


__all__ = ["ReadyHandoff", "handoff_enabled"]
