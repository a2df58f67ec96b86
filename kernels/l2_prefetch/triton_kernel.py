"""The kernels' side of kernels.l2_prefetch: each program requests its share of a byte range."""
from __future__ import annotations

import triton
import triton.language as tl

PREFETCH_THREADS = tl.constexpr(128)  # threads that issue a program's share (every host kernel runs 4 warps or more)


@triton.jit
def prefetch_l2(base, nbytes, pid, programs, THREADS: tl.constexpr):
    """Program `pid` of `programs` asks L2 for its share of the bytes [base, base + nbytes): each
    of THREADS threads one contiguous slice, in GRANULE units (base aligned, nbytes a multiple)."""
    units = nbytes // 16
    per_program = tl.cdiv(units, programs)
    per_thread = tl.cdiv(per_program, THREADS)
    lo = pid * per_program + tl.arange(0, THREADS) * per_thread
    hi = tl.minimum(tl.minimum(lo + per_thread, (pid + 1) * per_program), units)
    size = (tl.maximum(hi - lo, 0) * 16).to(tl.int32)
    addr = base + lo.to(tl.int64) * 16
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)



__all__ = ["prefetch_l2", "PREFETCH_THREADS"]
