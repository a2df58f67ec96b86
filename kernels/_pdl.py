"""The programmatic-dependent-launch prologue of the decode kernels (Hopper's griddepcontrol).

griddepcontrol.wait blocks until the previous kernel of the stream has finished and its writes are
visible; griddepcontrol.launch_dependents lets the next kernel's programs start (and load what
depends on no kernel: weights) before this one ends. Where a kernel signals its dependents is its
TRIGGER:

    0  before its own wait (launches run two deep: the next kernel starts while this one waits)
    1  right after its wait (the next kernel's programs sit resident while this one runs)
    2  after its main loop, before the epilogue (the next kernel arrives for the tail)

Every kernel waits before it writes anything another kernel touches, and before it reads what the
kernel just before it may have written; it finishes only after its wait, so "the kernel before me
finished" still implies every kernel before it did, whatever the trigger.

    pdl_trigger(USE_PDL, TRIGGER, 0)   # first thing in the kernel
    ...                                # loads that depend on no kernel (weight tiles), and with
                                       # EARLY those of settled inputs
    pdl_wait(USE_PDL, TRIGGER)         # before the first read of another kernel's output
    ...                                # the main loop
    pdl_trigger(USE_PDL, TRIGGER, 2)   # before the epilogue

Settled inputs: with every trigger at 1 or 2, a kernel's programs start only after the kernel
before it has passed its wait, so the kernel two launches back has finished and everything it and
the kernels before it wrote is in memory. A kernel may therefore read, before its own wait, inputs
its caller knows were written two or more launches back (`settled=True` at the call: the residual
stream and the step's rope rows and lengths in a decode layer, the cache rows of earlier steps);
`KernelOptions.early_reads_enabled` turns that off whenever a knob sets a trigger 0. Those reads
use the ".cg" cache modifier (L2, never a stale L1 line). A trigger 0 set in a table entry keeps them on:
the entry's promise that the launch after it reads early nothing the launch before it writes. A k
split's reduce always keeps it (SmallLinearConfig.reduce_trigger): the launch after the reduce may
start while the split kernel runs, but that kernel writes only its partials, which nothing but the
reduce reads. SmallLinearConfig.trigger 0 is the same promise for one weight (o before gate_up).

Imported only by Triton kernel modules (it imports triton).
"""
from __future__ import annotations

import triton
import triton.language as tl

AFTER_WAIT = tl.constexpr(1)   # TRIGGER 1: the point kernels without a KernelOptions.pdl_trigger knob use


@triton.jit
def pdl_trigger(USE_PDL: tl.constexpr, TRIGGER: tl.constexpr, HERE: tl.constexpr):
    """Signal the dependents here if this is the kernel's trigger point (HERE: 0 or 2)."""
    if USE_PDL and TRIGGER == HERE:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr, TRIGGER: tl.constexpr):
    """Wait for the previous kernel (and signal the dependents right after with TRIGGER 1)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if TRIGGER == 1:
            tl.extra.cuda.gdc_launch_dependents()
