"""Per-program timestamps of the decode kernels, for bench/timeline.py.

With a `Recorder` open (`recording(device)`), every launch of the small_linear, split-K reduce,
decode-attention split and merge kernels (and kernels.stream_linear's CUDA kernel, one row per
CTA, END once all its consumer warps are done) reserves one row per program in the recorder's buffer,
and each program writes there, from %globaltimer (ns; one clock for every multiprocessor, 32 ns
ticks on the H200):

    START   when the program began (before anything it loads)
    WAITED  when its griddepcontrol.wait returned (= START without programmatic dependent launch)
    END     when it was about to exit (after its last store was issued)
    SM      the multiprocessor it ran on (%smid)

A launch inside a CUDA graph capture keeps the rows it reserved, so each replay overwrites them:
after a replay they hold that replay's times. With no recorder open the kernels are compiled with
TRACE=False, which removes every mark (no register, no store), and get a dummy pointer.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# the row's columns (constexpr: the kernels name them)
START, WAITED, END, SM = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)
COLUMNS = tl.constexpr(4)


@dataclass(frozen=True)
class Launch:
    label: str            # kernel and shape, e.g. "linear 2048x1536 rope"
    first_row: int        # its programs' rows: first_row .. first_row + programs - 1
    programs: int
    captured: bool        # launched inside a CUDA graph capture (replays write its rows)


class Recorder:
    def __init__(self, device: torch.device, capacity: int):
        self.rows = torch.zeros(capacity, COLUMNS.value, dtype=torch.int64, device=device)
        self.launches: list[Launch] = []
        self._next = 0

    def reserve(self, label: str, programs: int) -> int:
        """Rows for a launch of `programs` programs -> the first one's index."""
        if self._next + programs > self.rows.shape[0]:
            raise RuntimeError(f"trace recorder full ({self.rows.shape[0]} rows): open it with a larger capacity")
        first = self._next
        self._next += programs
        captured = self.rows.is_cuda and torch.cuda.is_current_stream_capturing()
        self.launches.append(Launch(label, first, programs, captured))
        return first


_ACTIVE: Recorder | None = None


@contextmanager
def recording(device: torch.device, capacity: int = 1 << 22):
    """Open a recorder for the launches made inside the block (CUDA only: the marks are PTX)."""
    global _ACTIVE
    if torch.device(device).type != "cuda":
        raise ValueError("kernel traces read %globaltimer: CUDA only")
    previous, _ACTIVE = _ACTIVE, Recorder(torch.device(device), capacity)
    try:
        yield _ACTIVE
    finally:
        _ACTIVE = previous


def trace_args(label: str, grid: tuple[int, ...], dummy: torch.Tensor) -> dict:
    """The launch keywords (Trace, trace_row, TRACE) of a traced kernel: rows in the open
    recorder, or `dummy` (any tensor of the call) and TRACE=False when there is none."""
    if _ACTIVE is None:
        return dict(Trace=dummy, trace_row=0, TRACE=False)
    return dict(Trace=_ACTIVE.rows, trace_row=_ACTIVE.reserve(label, math.prod(grid)), TRACE=True)


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def trace_mark(Trace, trace_row, COLUMN: tl.constexpr, TRACE: tl.constexpr):
    """Write this program's time into column COLUMN of its row (and its multiprocessor with START)."""
    if TRACE:
        program = (tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
                   + tl.program_id(2) * tl.num_programs(0) * tl.num_programs(1))
        row = Trace + (trace_row + program).to(tl.int64) * COLUMNS
        tl.store(row + COLUMN, _globaltimer())
        if COLUMN == START:
            sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)
            tl.store(row + SM, sm.to(tl.int64))


__all__ = ["Recorder", "Launch", "recording", "trace_args", "trace_mark", "START", "WAITED", "END", "SM"]
