"""Does a persistent decode layer beat the chain of launches it would replace? A probe, not built
into the engine (the last lead for 70% of the roofline at Qwen2.5-1.5B: kernels/small_matmul/NOTES.md).
Measured in stop 18: no, see the end of this docstring.

    python bench/persistent_layer.py [--layers 28] [--context 512] [--modes half,layer,hybrid] [--warps 8,4] [--split-t 64,32]
    python bench/persistent_layer.py --resources          # registers for sm_90, no GPU needed
    TRITON_INTERPRET=1 python bench/persistent_layer.py --device cpu --layers 2 --dtype float32 --split-t 64 --warps 8

At batch 1 a Qwen2.5-1.5B layer is seven launches (qkv with the norm folded in and rope + the
cache write in its epilogue; the attention split and merge; o + residual; gate/up + silu*mul; down
in 10 k splits; their reduce + residual), 39 us for 22.3 us of weight bytes; the attention half
alone (the first four) some 12.7 us for 11 MB (NOTES.md, "Read first"). This probe runs the same
maths as ONE launch per layer ("layer"), or per attention half ("half"; "hybrid" follows each
half with the engine's own gate_up, down and reduce launches, as the half would run in a step). Its 128 programs (one per
multiprocessor) ask for the weights of their next stage before they wait for the stage before,
and pass the stages through counters in global memory instead of kernel boundaries:

  qkv        every program: 16 rows of the q/k/v weight (8 rope pairs of one head), asked for
             before the launch's griddepcontrol.wait; the rows' norm scale, bias, rope, q into a
             buffer, k/v into the cache; then it counts itself in its kv group's counter
  attention  2 x SPLITS programs (the last ones): the SPLIT_T settled cache rows of one split of
             one kv head, read before any wait; they wait for their group's q/k/v rows, then write
             the split's partial (max, sum, unnormalised output) for its 6 q heads
  o          96 programs (the first ones): 16 rows of o, read before any wait; they wait for every
             split, merge all 12 heads themselves (48 KB of partials each, from the L2), and write
             h + o and the next norm's inputs (norm_weight * h, their part of the sum of squares)
  gate/up    ("layer") every program: 70 act values (gate rows i, up rows 8960 + i; 68 or 67
             with 132 programs) in tiles of 8 pairs, streamed as [8, 2, 512] units (16 KB) through
             a queue of 4: the first 4 are asked for right after qkv, so they stream while the
             attention stages run; then unit i + 4 is asked for before unit i is summed
  down       ("layer") every program: 12 of the 1536 rows (11 or 12 with 132) over all 8960
             columns (no k split, so no reduce), [16, 512] units of weights and act in a queue of 4,
             the first 4 weight units asked for before the wait on gate/up; h + down and the next
             layer's inputs

Between layers the launches stay PDL-chained (griddepcontrol): the next layer's programs start
as this one's end. The baselines are the engine's own launches on the same weights and caches
(engine.model.Attention + fused_project for the half, Block for the layer), captured and replayed
the same way, in the same run. Every variant runs `--layers` layers of distinct weights (past the
L2) per graph replay; the table gives us per layer, the ratio to the chain, and from a traced
replay (%globaltimer per program and stage) when each stage's wait returned and when it ended,
from the end of the layer before. 128 programs leave 4 of the 132 multiprocessors idle; in the
layer's streaming stages that costs up to 3% of the bandwidth.

The outputs are compared with the engine's after one layer: the same maths with the sums in
another order (CUDA-core products, not tl.dot tiles), so close, not bit for bit; a kernel built on
this would need its own verify path for decode == verify. Every program of a layer must be
resident at once or a stage's wait never ends: a wait gives up after MAX_SPINS polls and counts
itself ("gave up"), so a probe that would deadlock ends with a count instead.

On the CPU (TRITON_INTERPRET=1) the stages run as separate launches, in order, without the
counters. tests/kernels/test_persistent_probe.py checks the maths there against a float32
reference; `--device cpu` against the engine's own path at the real shape (stop 18, float32: the
layer's contribution to the stream within 6.4e-07 (half) and 1.4e-06 (layer) relative error).
`--resources` (stop 18, sm_90, 8 splits): on 8 warps 205 registers (half) and 218 (layer; 226 with
the trace), no spill, one program per multiprocessor; on 4 warps both spill. The trace's timer
reads are ordered, so they may also move the compiler's schedule: the table times the untraced
kernel and takes the stage columns from a second, traced replay.

H200, stop 18 (NOTES.md, "Stop 18"), µs per layer:
- the whole layer 63.0 against the chain's 39.3: gate_up and down stream at about 1.8 TB/s, the
  per-program limit of plain loads;
- the attention half alone 14.2-14.8 against its chain's 16.8;
- the half followed by the engine's MLP (`--modes hybrid`) 44.2 against 38.4.

Slower as soon as it runs inside a layer, so it was not built into the engine.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from batchd.kernels._backend import interpreting, launch_options  # noqa: E402
from batchd.kernels._trace import _globaltimer  # noqa: E402
from batchd.engine.fused import rotate  # noqa: E402
from batchd.kernels.decode_attention.reference import decode_attention_reference  # noqa: E402
from batchd.kernels.decode_attention.triton_kernel import dot_flags  # noqa: E402
from batchd.kernels.rope_cache.triton_kernel import rope_rows_at, rotate_with  # noqa: E402

O_ROWS = 16        # o weight rows per program (the qkv stage: 8 rope pairs, rows d and d + D/2)
MAX_SPINS = tl.constexpr(1 << 16)   # polls before a wait gives up (some 50 ms; a healthy wait takes a few)
# per program: START, WAITED (griddepcontrol), then each stage's wait return and end, END, its role
COLUMN_NAMES = ("start", "waited", "qkv done", "attn waited", "attn done", "o waited", "o done", "gate_up waited",
                "gate_up done", "down waited", "end", "role")
TRACE_COLUMNS = tl.constexpr(len(COLUMN_NAMES))
(START, WAITED, QKV_DONE, ATTN_WAITED, ATTN_DONE, O_WAITED, O_DONE, GU_WAITED, GU_DONE, DOWN_WAITED, END,
 ROLE) = (tl.constexpr(i) for i in range(len(COLUMN_NAMES)))


@triton.jit
def _mark(Trace, row, COLUMN: tl.constexpr, TRACE: tl.constexpr):
    if TRACE:
        tl.store(Trace + row * TRACE_COLUMNS + COLUMN, _globaltimer())


@triton.jit
def _wait_count(Counter, target, Stuck, SYNC: tl.constexpr):
    """Spin until *Counter >= target (acquire; the data behind it is then read with .cg)."""
    if SYNC:
        spins = 0
        while (tl.atomic_add(Counter, 0, sem="acquire", scope="gpu") < target) & (spins < MAX_SPINS):
            spins += 1
        if spins >= MAX_SPINS:
            tl.atomic_add(Stuck, 1)


@triton.jit
def _arrive(Counter, SYNC: tl.constexpr):
    """Count this program in (every thread's stores are issued before the release)."""
    if SYNC:
        tl.debug_barrier()
        tl.atomic_add(Counter, 1, sem="release", scope="gpu")


@triton.jit
def _dot(a, b, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    if UPCAST_DOT:       # the interpreter multiplies bf16 tiles as raw integers (decode_attention.dot_flags)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=DOT_PRECISION)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _normed_input(X, SumSq, n_parts, kk, KC: tl.constexpr, HID: tl.constexpr, PARTS_P2: tl.constexpr, eps):
    """A folded RMSNorm's inputs, written by other programs (read from the L2): x = norm_weight * h
    as three float32 [KC] chunks, and the rows' scale rsqrt(mean(h^2) + eps) from n_parts sums."""
    x0 = tl.load(X + kk, cache_modifier=".cg").to(tl.float32)
    x1 = tl.load(X + KC + kk, cache_modifier=".cg").to(tl.float32)
    x2 = tl.load(X + 2 * KC + kk, cache_modifier=".cg").to(tl.float32)
    parts = tl.arange(0, PARTS_P2)
    sumsq = tl.load(SumSq + parts, mask=parts < n_parts, other=0.0, cache_modifier=".cg")
    return x0, x1, x2, tl.rsqrt(tl.sum(sumsq, 0) / HID + eps)


@triton.jit
def _gate_up_unit(gu_ptrs, i, pair_lo, pair_hi, UNITS: tl.constexpr, NKC: tl.constexpr, KC: tl.constexpr,
                  HID: tl.constexpr):
    """Unit i of a program's gate/up stream: tile i // NKC (8 pairs), columns chunk i % NKC, as
    [8, 2, KC] in the model dtype (zeros past the program's pairs or past its last unit)."""
    t = i // NKC
    pairs = pair_lo + t * 8 + tl.arange(0, 8)
    ok = (pairs < pair_hi) & (i < UNITS)
    return tl.load(gu_ptrs + t * 8 * HID + (i % NKC) * KC, mask=ok[:, None, None], other=0.0)


@triton.jit
def _down_unit(d_ptrs, j, d_ok, kd, INTER: tl.constexpr, DKC: tl.constexpr):
    """Columns chunk j of a program's down rows, [16, DKC] (zeros past its rows or past INTER)."""
    return tl.load(d_ptrs + j * DKC, mask=d_ok[:, None] & (j * DKC + kd < INTER)[None, :], other=0.0)


@triton.jit
def _act_unit(Act, j, kd, INTER: tl.constexpr, DKC: tl.constexpr):
    """Chunk j of the act vector in float32 (written by other programs: read from the L2)."""
    k = j * DKC + kd
    return tl.load(Act + k, mask=k < INTER, other=0.0, cache_modifier=".cg").to(tl.float32)


@triton.jit
def _persistent_layer(
    X, SumSqIn, n_parts, Res,            # weighted [HID] (norm_w * h), sumsq parts [n_parts] f32, h [HID]
    Wqkv, Bqkv, Wo, ONormW,              # [QKV_ROWS, HID], [QKV_ROWS], [HID, HID], [HID]: the norm o emits for
                                         # (the post-attention norm with MLP, else the next layer's input norm)
    Wgu, Wdown, DownNormW,               # MLP: [2 * INTER, HID] (gate rows, then up rows), [HID, INTER], [HID]
    HMid, XMid, SumSqMid, Act,           # MLP scratch: o's h, norm_w * h [HID], sumsq [O_PROGRAMS] f32; act [INTER]
    Cos, Sin, pos,                       # [1, D] f32 rope rows at the step's position, its cache row
    KCache, VCache,                      # [HKV, S_MAX, D] (batch 1)
    Q, OPart, MPart, LPart,              # scratch: [HQ * D] model dtype; [HKV, SPLITS, G_P2, D], [HKV, SPLITS, G_P2] f32
    Counters, Stuck,                     # [HKV + 3] int32, zeroed before each run; [1] int32
    Out, WeightedOut, SumSqOut,          # [HID], [HID], [O_PROGRAMS] f32 (MLP: [programs] f32)
    Trace,                               # [programs, TRACE_COLUMNS] int64 when TRACE
    eps, scale_log2e, s_max,
    HID: tl.constexpr, KC: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    SPLITS: tl.constexpr, SPLIT_T: tl.constexpr, G_P2: tl.constexpr, PARTS_P2: tl.constexpr,
    O_PARTS_P2: tl.constexpr,            # next_power_of_2(HID // 16): the o programs' sumsq parts
    MLP: tl.constexpr, INTER: tl.constexpr, GU_TILES: tl.constexpr, DKC: tl.constexpr,
    DOWN_CHUNKS: tl.constexpr,           # MLP: gate/up tiles of 8 pairs per program, down's k chunks of DKC
    STAGE: tl.constexpr,                 # 0: every stage, synchronised by the counters; 1-5: that stage only
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, TRACE: tl.constexpr,
):
    NKC: tl.constexpr = HID // KC
    tl.static_assert(NKC == 3)           # the weight rows are held as three [rows, KC] register tiles
    HALF: tl.constexpr = D // 2
    GROUP: tl.constexpr = HQ // HKV
    O_PROGRAMS: tl.constexpr = HID // 16
    HEADS_PER_KC: tl.constexpr = KC // D
    SYNC: tl.constexpr = STAGE == 0
    dtype = KCache.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    trace_row = pid.to(tl.int64)
    _mark(Trace, trace_row, START, TRACE)

    # ---- what depends on no earlier launch: weights, rope rows, settled cache rows ----------
    # qkv: this program's 8 rope pairs of one head, as [8, 2, KC] tiles (rows d and d + D/2)
    head = pid // (HALF // 8)
    d_lo = (pid % (HALF // 8)) * 8 + tl.arange(0, 8)                       # [8] dims in [0, D/2)
    half = tl.arange(0, 2)
    kk = tl.arange(0, KC)
    QKV_PROGRAMS: tl.constexpr = (HQ + 2 * HKV) * (HALF // 8)
    is_qkv = pid < QKV_PROGRAMS                     # programs past them only join the MLP stages
    qkv_rows = head * D + d_lo[:, None] + HALF * half[None, :]              # [8, 2]
    w_ptrs = Wqkv + qkv_rows[:, :, None].to(tl.int64) * HID + kk[None, None, :]
    wq0 = tl.load(w_ptrs, mask=is_qkv, other=0.0)
    wq1 = tl.load(w_ptrs + KC, mask=is_qkv, other=0.0)
    wq2 = tl.load(w_ptrs + 2 * KC, mask=is_qkv, other=0.0)
    bias = tl.load(Bqkv + qkv_rows, mask=is_qkv, other=0.0).to(tl.float32)  # [8, 2]
    cos1, cos2, sin1, sin2 = rope_rows_at(Cos + d_lo, Sin + d_lo, HALF, d_lo < HALF, dtype)
    # o: rows [16 pid, 16 pid + 16) for the first O_PROGRAMS programs
    is_o = pid < O_PROGRAMS
    o_rows = (pid % O_PROGRAMS) * 16 + tl.arange(0, 16)
    wo_ptrs = Wo + o_rows[:, None].to(tl.int64) * HID + kk[None, :]
    wo0 = tl.load(wo_ptrs, mask=is_o, other=0.0)
    wo1 = tl.load(wo_ptrs + KC, mask=is_o, other=0.0)
    wo2 = tl.load(wo_ptrs + 2 * KC, mask=is_o, other=0.0)
    # attention: the last HKV * SPLITS programs, SPLIT_T settled rows of one split of one kv head
    first_attn = nprog - HKV * SPLITS
    is_attn = pid >= first_attn
    a = tl.maximum(pid - first_attn, 0)
    g = a // SPLITS
    s = a % SPLITS
    tok = s * SPLIT_T + tl.arange(0, SPLIT_T)
    dd = tl.arange(0, D)
    kv_off = (g * s_max + tok[:, None]).to(tl.int64) * D + dd[None, :]
    kt = tl.load(KCache + kv_off, mask=is_attn, other=0.0, cache_modifier=".cg")   # [SPLIT_T, D]
    vt = tl.load(VCache + kv_off, mask=is_attn, other=0.0, cache_modifier=".cg")

    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    _mark(Trace, trace_row, WAITED, TRACE)

    # ---- stage 1: q/k/v rows -----------------------------------------------------------------
    if STAGE == 0 or STAGE == 1:
        if is_qkv:
            x0, x1, x2, row_scale = _normed_input(X, SumSqIn, n_parts, kk, KC, HID, PARTS_P2, eps)
            acc = tl.sum(wq0.to(tl.float32) * x0[None, None, :], 2)
            acc += tl.sum(wq1.to(tl.float32) * x1[None, None, :], 2)
            acc += tl.sum(wq2.to(tl.float32) * x2[None, None, :], 2)           # [8, 2]
            y = (acc * row_scale + bias).to(dtype).to(tl.float32)
            y1, y2 = tl.split(y)                                                 # dims d, d + D/2
            if head < HQ + HKV:
                y1, y2 = rotate_with(y1, y2, cos1, cos2, sin1, sin2)
            if head < HQ:
                dst = Q + head * D + d_lo
            elif head < HQ + HKV:
                dst = KCache + ((head - HQ) * s_max + pos).to(tl.int64) * D + d_lo
            else:
                dst = VCache + ((head - HQ - HKV) * s_max + pos).to(tl.int64) * D + d_lo
            tl.store(dst, y1.to(dtype))
            tl.store(dst + HALF, y2.to(dtype))
            group = tl.where(head < HQ, head // GROUP, tl.where(head < HQ + HKV, head - HQ, head - HQ - HKV))
            _arrive(Counters + group, SYNC)
    _mark(Trace, trace_row, QKV_DONE, TRACE)

    # ---- stage 2: one split of one kv head's attention, for its GROUP q heads -----------------
    if STAGE == 0 or STAGE == 2:
        if is_attn:
            # q/k/v programs per group: GROUP q heads, one k and one v head, HALF // 8 programs each
            _wait_count(Counters + g, (GROUP + 2) * (HALF // 8), Stuck, SYNC)
            _mark(Trace, trace_row, ATTN_WAITED, TRACE)
            hq = tl.arange(0, G_P2)
            q = tl.load(Q + (g * GROUP + hq)[:, None] * D + dd[None, :], mask=(hq < GROUP)[:, None], other=0.0,
                        cache_modifier=".cg")                                    # [G_P2, D]
            scores = _dot(q, tl.trans(kt), UPCAST_DOT, DOT_PRECISION) * scale_log2e                      # [G_P2, SPLIT_T]
            new_off = (g * s_max + pos).to(tl.int64) * D + dd
            k_new = tl.load(KCache + new_off, cache_modifier=".cg").to(tl.float32)
            v_new = tl.load(VCache + new_off, cache_modifier=".cg").to(tl.float32)
            s_new = tl.sum(q.to(tl.float32) * k_new[None, :], 1) * scale_log2e   # [G_P2]
            s_new = tl.where(s == SPLITS - 1, s_new, -float("inf"))             # the new row: the last split's
            m = tl.maximum(tl.max(scores, 1), s_new)
            p = tl.exp2(scores - m[:, None])
            p_new = tl.exp2(s_new - m)
            l_sum = tl.sum(p, 1) + p_new
            o_acc = _dot(p.to(dtype), vt, UPCAST_DOT, DOT_PRECISION) + p_new[:, None] * v_new[None, :]    # [G_P2, D]
            part = (g * SPLITS + s) * G_P2 + hq
            tl.store(OPart + part[:, None].to(tl.int64) * D + dd[None, :], o_acc)
            tl.store(MPart + part, m)
            tl.store(LPart + part, l_sum)
            _arrive(Counters + HKV, SYNC)
            _mark(Trace, trace_row, ATTN_DONE, TRACE)

    # ---- stage 3: merge the splits of all heads, o + residual, the next norm's inputs --------
    if STAGE == 0 or STAGE == 3:
        if is_o:
            res = tl.load(Res + o_rows, cache_modifier=".cg").to(tl.float32)
            next_nw = tl.load(ONormW + o_rows).to(tl.float32)
            _wait_count(Counters + HKV, HKV * SPLITS, Stuck, SYNC)
            _mark(Trace, trace_row, O_WAITED, TRACE)
            sp = tl.arange(0, SPLITS)
            hc = tl.arange(0, HEADS_PER_KC)
            acc_o = tl.zeros([16], dtype=tl.float32)
            for c in tl.static_range(NKC):
                h = c * HEADS_PER_KC + hc                                        # [HEADS_PER_KC] q heads
                part = ((h // GROUP)[:, None] * SPLITS + sp[None, :]) * G_P2 + (h % GROUP)[:, None]
                m_p = tl.load(MPart + part, cache_modifier=".cg")                # [heads, SPLITS]
                l_p = tl.load(LPart + part, cache_modifier=".cg")
                m_all = tl.max(m_p, 1)
                w_s = tl.exp2(m_p - m_all[:, None])
                denom = tl.sum(w_s * l_p, 1)
                o_p = tl.load(OPart + part[:, :, None].to(tl.int64) * D + dd[None, None, :],
                              cache_modifier=".cg")                              # [heads, SPLITS, D]
                att = tl.sum(w_s[:, :, None] * o_p, 1) / denom[:, None]          # [heads, D]
                att = tl.reshape(att.to(dtype).to(tl.float32), [KC])
                if c == 0:
                    acc_o += tl.sum(wo0.to(tl.float32) * att[None, :], 1)
                elif c == 1:
                    acc_o += tl.sum(wo1.to(tl.float32) * att[None, :], 1)
                else:
                    acc_o += tl.sum(wo2.to(tl.float32) * att[None, :], 1)
            h_new = (acc_o.to(dtype).to(tl.float32) + res).to(dtype)
            h32 = h_new.to(tl.float32)
            if MLP:
                tl.store(HMid + o_rows, h_new)
                tl.store(XMid + o_rows, (h32 * next_nw).to(dtype))
                tl.store(SumSqMid + pid, tl.sum(h32 * h32, 0))
                _arrive(Counters + HKV + 1, SYNC)
            else:
                tl.store(Out + o_rows, h_new)
                tl.store(WeightedOut + o_rows, (h32 * next_nw).to(dtype))
                tl.store(SumSqOut + pid, tl.sum(h32 * h32, 0))
    _mark(Trace, trace_row, O_DONE, TRACE)

    if MLP:
        # ---- stage 4: gate/up (the post-attention norm folded in), silu(gate) * up -------------
        # this program's act indices [pair_lo, pair_hi): gate row i and up row INTER + i each, in
        # tiles of 8 pairs; the weights stream as units of one tile's KC columns ([8, 2, KC], 16 KB)
        # through a queue of 4: unit i + 4 is asked for before unit i is summed (64 KB in flight)
        pair_lo = pid * INTER // nprog
        pair_hi = (pid + 1) * INTER // nprog
        i8 = tl.arange(0, 8)
        gu_rows = pair_lo + i8[:, None] + INTER * half[None, :]                  # [8, 2] of tile 0
        gu_ptrs = Wgu + gu_rows[:, :, None].to(tl.int64) * HID + kk[None, None, :]
        GU_UNITS: tl.constexpr = GU_TILES * NKC
        # the first 4 units are asked for now, while the attention stages run (they depend on none)
        u0 = _gate_up_unit(gu_ptrs, 0, pair_lo, pair_hi, GU_UNITS, NKC, KC, HID)
        u1 = _gate_up_unit(gu_ptrs, 1, pair_lo, pair_hi, GU_UNITS, NKC, KC, HID)
        u2 = _gate_up_unit(gu_ptrs, 2, pair_lo, pair_hi, GU_UNITS, NKC, KC, HID)
        u3 = _gate_up_unit(gu_ptrs, 3, pair_lo, pair_hi, GU_UNITS, NKC, KC, HID)
        if STAGE == 0 or STAGE == 4:
            _wait_count(Counters + HKV + 1, O_PROGRAMS, Stuck, SYNC)
            _mark(Trace, trace_row, GU_WAITED, TRACE)
            x0, x1, x2, mid_scale = _normed_input(XMid, SumSqMid, O_PROGRAMS, kk, KC, HID, O_PARTS_P2, eps)
            acc = tl.zeros([8, 2], dtype=tl.float32)
            for i in range(GU_UNITS):
                u4 = _gate_up_unit(gu_ptrs, i + 4, pair_lo, pair_hi, GU_UNITS, NKC, KC, HID)
                c = i % NKC
                x = tl.where(c == 0, x0, tl.where(c == 1, x1, x2))
                acc += tl.sum(u0.to(tl.float32) * x[None, None, :], 2)           # [8, 2]
                # after a tile's last unit: small_linear's gated epilogue (gate, up and silu(gate)
                # each rounded to the model dtype), stored; the sums start again
                gate, up = tl.split(acc * mid_scale)
                gt = gate.to(dtype).to(tl.float32)
                silu = (gt / (1.0 + tl.exp(-gt))).to(dtype).to(tl.float32)
                act = (silu * up.to(dtype).to(tl.float32)).to(dtype)
                pairs = pair_lo + (i // NKC) * 8 + i8
                tl.store(Act + pairs, act, mask=(pairs < pair_hi) & (c == NKC - 1))
                acc = tl.where(c == NKC - 1, 0.0, acc)
                u0, u1, u2, u3 = u1, u2, u3, u4
            _arrive(Counters + HKV + 2, SYNC)
        _mark(Trace, trace_row, GU_DONE, TRACE)

        # ---- stage 5: down + residual, the next layer's norm inputs ----------------------------
        # rows [row_lo, row_hi) (12 at 1.5B) over all INTER columns, no k split; the weights and
        # the act stream as [16, DKC] and [DKC] units through a queue of 4, as in stage 4
        row_lo = pid * HID // nprog
        row_hi = (pid + 1) * HID // nprog
        d_rows = row_lo + tl.arange(0, 16)
        d_ok = d_rows < row_hi
        kd = tl.arange(0, DKC)
        d_ptrs = Wdown + d_rows[:, None].to(tl.int64) * INTER + kd[None, :]
        v0 = _down_unit(d_ptrs, 0, d_ok, kd, INTER, DKC)
        v1 = _down_unit(d_ptrs, 1, d_ok, kd, INTER, DKC)
        v2 = _down_unit(d_ptrs, 2, d_ok, kd, INTER, DKC)
        v3 = _down_unit(d_ptrs, 3, d_ok, kd, INTER, DKC)
        if STAGE == 0 or STAGE == 5:
            res2 = tl.load(HMid + d_rows, mask=d_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            down_nw = tl.load(DownNormW + d_rows, mask=d_ok, other=0.0).to(tl.float32)
            _wait_count(Counters + HKV + 2, nprog, Stuck, SYNC)
            _mark(Trace, trace_row, DOWN_WAITED, TRACE)
            a0 = _act_unit(Act, 0, kd, INTER, DKC)
            a1 = _act_unit(Act, 1, kd, INTER, DKC)
            a2 = _act_unit(Act, 2, kd, INTER, DKC)
            a3 = _act_unit(Act, 3, kd, INTER, DKC)
            acc_d = tl.zeros([16], dtype=tl.float32)
            for j in range(DOWN_CHUNKS):
                v4 = _down_unit(d_ptrs, j + 4, d_ok, kd, INTER, DKC)
                a4 = _act_unit(Act, j + 4, kd, INTER, DKC)
                acc_d += tl.sum(v0.to(tl.float32) * a0[None, :], 1)
                v0, v1, v2, v3 = v1, v2, v3, v4
                a0, a1, a2, a3 = a1, a2, a3, a4
            h2 = (acc_d.to(dtype).to(tl.float32) + res2).to(dtype)
            tl.store(Out + d_rows, h2, mask=d_ok)
            h2_32 = tl.where(d_ok, h2.to(tl.float32), 0.0)
            tl.store(WeightedOut + d_rows, (h2_32 * down_nw).to(dtype), mask=d_ok)
            tl.store(SumSqOut + pid, tl.sum(h2_32 * h2_32, 0))
    _mark(Trace, trace_row, END, TRACE)
    if TRACE:
        tl.store(Trace + trace_row * TRACE_COLUMNS + ROLE, is_o.to(tl.int64) + 2 * is_attn.to(tl.int64))


class PersistentLayer:
    """One decode layer's attention half, or with `mlp` the whole layer, as one launch at a fixed
    context (cache rows before the new one): its weights, its cache, scratch buffers.
    `run(x, sumsq, h, ...)` -> (h_new, norm_w * h_new, h_new's sumsq parts): the next layer's inputs.
    `counters` ([HKV + 3] int32) must be zeroed before each run.

    emit_norm_w: the norm weight of the next projection after the attention half (the post-attention
    norm when mlp, else the next layer's input norm). mlp: (gate_up [2I, H], down [H, I], the next
    layer's input norm weight [H])."""

    def __init__(self, qkv_w, qkv_b, o_w, emit_norm_w, k_cache, v_cache, counters, *, num_heads, num_kv_heads,
                 eps, context, mlp=None, programs=None, split_t=64, kc=512, dkc=512, num_warps=8):
        self.qkv_w, self.qkv_b, self.o_w, self.emit_norm_w = qkv_w, qkv_b, o_w, emit_norm_w
        self.k_cache, self.v_cache, self.counters = k_cache, v_cache, counters   # caches [HKV, S_MAX, D]
        self.hq, self.hkv = num_heads, num_kv_heads
        self.hid, self.d = o_w.shape[0], k_cache.shape[-1]
        self.eps, self.split_t, self.kc, self.dkc, self.num_warps = eps, split_t, kc, dkc, num_warps
        splits = context // split_t
        if context % split_t or splits & (splits - 1):
            raise ValueError(f"the probe needs a context of a power-of-two count of {split_t}-row splits, "
                             f"got {context}")
        self.context, self.splits = context, splits
        self.g_p2 = max(16, triton.next_power_of_2(num_heads // num_kv_heads))
        qkv_programs = (num_heads + 2 * num_kv_heads) * (self.d // 16)
        # the qkv stage's programs; with mlp more may join the MLP stages (132: every H200 multiprocessor)
        self.programs = programs or qkv_programs
        if self.programs < qkv_programs or (self.programs > qkv_programs and mlp is None):
            raise ValueError(f"{qkv_programs} programs, or more with mlp, got {self.programs}")
        if self.hid // O_ROWS + num_kv_heads * splits > self.programs:
            raise ValueError("the o programs and the attention programs would overlap")
        dev, dt = o_w.device, o_w.dtype
        self.q = torch.empty(num_heads * self.d, device=dev, dtype=dt)
        self.o_part = torch.zeros(num_kv_heads, splits, self.g_p2, self.d, device=dev, dtype=torch.float32)
        self.m_part = torch.zeros(num_kv_heads, splits, self.g_p2, device=dev, dtype=torch.float32)
        self.l_part = torch.zeros(num_kv_heads, splits, self.g_p2, device=dev, dtype=torch.float32)
        self.out = torch.empty(self.hid, device=dev, dtype=dt)
        self.weighted = torch.empty(self.hid, device=dev, dtype=dt)
        self.mlp = mlp
        if mlp is None:
            self.inter = 0
            self.gu_w = self.down_w = self.down_norm_w = o_w
            self.h_mid = self.x_mid = self.act = self.out
            self.sumsq_mid = None
            self.sumsq = torch.zeros(self.hid // O_ROWS, device=dev, dtype=torch.float32)
        else:
            self.gu_w, self.down_w, self.down_norm_w = mlp
            self.inter = self.down_w.shape[1]
            if self.hid > O_ROWS * self.programs:
                raise ValueError("down takes at most 16 rows per program")
            self.h_mid = torch.empty(self.hid, device=dev, dtype=dt)
            self.x_mid = torch.empty(self.hid, device=dev, dtype=dt)
            self.act = torch.empty(self.inter, device=dev, dtype=dt)
            self.sumsq_mid = torch.zeros(self.hid // O_ROWS, device=dev, dtype=torch.float32)
            self.sumsq = torch.zeros(self.programs, device=dev, dtype=torch.float32)
        pairs = triton.cdiv(self.inter, self.programs)           # the most pairs a program takes
        self.gu_tiles = triton.cdiv(pairs, 8)
        self.down_chunks = triton.cdiv(self.inter, dkc)

    def run(self, x, sumsq, h, cos, sin, stuck, *, stages=(0,), pdl=True, trace=None):
        """x = norm_weight * h [HID], sumsq [P] f32 parts of h's sum of squares, h [HID]; cos, sin
        [1, D] f32 at the context's position. stages (0,) on the GPU; in the interpreter each stage
        in turn: (1, 2, 3), with mlp (1, 2, 3, 4, 5)."""
        pdl = pdl and not interpreting()
        upcast, precision = dot_flags(self.k_cache.dtype)
        for stage in stages:
            _persistent_layer[(self.programs,)](
                x, sumsq, sumsq.numel(), h, self.qkv_w, self.qkv_b, self.o_w, self.emit_norm_w,
                self.gu_w, self.down_w, self.down_norm_w,
                self.h_mid, self.x_mid, self.sumsq_mid if self.sumsq_mid is not None else self.sumsq, self.act,
                cos, sin, self.context, self.k_cache, self.v_cache, self.q, self.o_part, self.m_part, self.l_part,
                self.counters, stuck, self.out, self.weighted, self.sumsq,
                trace if trace is not None else self.sumsq,
                self.eps, math.log2(math.e) / math.sqrt(self.d), self.k_cache.shape[1],
                HID=self.hid, KC=self.kc, HQ=self.hq, HKV=self.hkv, D=self.d, SPLITS=self.splits,
                SPLIT_T=self.split_t, G_P2=self.g_p2, PARTS_P2=max(128, triton.next_power_of_2(sumsq.numel())),
                O_PARTS_P2=triton.next_power_of_2(self.hid // O_ROWS),
                MLP=self.mlp is not None, INTER=max(self.inter, 1), GU_TILES=self.gu_tiles, DKC=self.dkc,
                DOWN_CHUNKS=self.down_chunks, STAGE=stage, UPCAST_DOT=upcast, DOT_PRECISION=precision, USE_PDL=pdl,
                TRACE=trace is not None, num_warps=self.num_warps, **launch_options(pdl))
        return self.out, self.weighted, self.sumsq


def reference_layer(x, sumsq, h, qkv_w, qkv_b, o_w, emit_norm_w, k_cache, v_cache, cos, sin, pos, *,
                    num_heads, num_kv_heads, eps, mlp=None):
    """float32 twin of `PersistentLayer` (the caches get the new k/v row, rounded), with the same
    roundings to the model dtype: -> (h_new, norm_w * h_new, h_new's sum of squares)."""
    dt = x.dtype
    hid, d = o_w.shape[0], k_cache.shape[-1]
    scale = torch.rsqrt(sumsq.float().sum() / hid + eps)
    y = (qkv_w.float() @ x.float()) * scale + qkv_b.float()
    y = y.to(dt).float()
    q, k, v = y.split([num_heads * d, num_kv_heads * d, num_kv_heads * d])
    # the eager rope in float32 with tables rounded to the model dtype, as the kernel rotates
    rounded = cos.to(dt).float(), sin.to(dt).float()
    q, k = (rotate(t.view(1, -1, 1, d), *rounded).view(-1, d).to(dt) for t in (q, k))
    k_cache[:, pos] = k
    v_cache[:, pos] = v.view(-1, d).to(dt)
    att = decode_attention_reference(q.float().view(1, num_heads, 1, d), k_cache[None], v_cache[None],
                                     torch.tensor([pos + 1]))                    # [1, Hq, 1, D] float32
    att = att.reshape(-1).to(dt).float()
    h_new = ((o_w.float() @ att).to(dt).float() + h.float()).to(dt)
    if mlp is not None:
        gu_w, down_w, down_norm_w = mlp
        x1 = (h_new.float() * emit_norm_w.float()).to(dt).float()
        gu = (gu_w.float() @ x1) * torch.rsqrt((h_new.float() ** 2).sum() / hid + eps)
        gate, up = gu.chunk(2)
        gate = gate.to(dt).float()
        silu = (gate / (1 + torch.exp(-gate))).to(dt).float()
        act = (silu * up.to(dt).float()).to(dt).float()
        h_new = ((down_w.float() @ act).to(dt).float() + h_new.float()).to(dt)
        emit_norm_w = down_norm_w
    return h_new, (h_new.float() * emit_norm_w.float()).to(dt), (h_new.float() ** 2).sum()


def main() -> None:
    from bench.common import copy_bandwidth, graph_replay_time, print_table
    from batchd.engine import fused
    from batchd.engine.kv_cache import KVCache
    from batchd.engine.linear import enable_invariant_kernel
    from batchd.engine.model import fused_project
    from batchd.engine.presets import preset
    from batchd.engine.runtime import build_model
    from batchd.kernels.step_inputs import step_inputs

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--context", type=int, default=512, help="cache rows before the new token")
    parser.add_argument("--warps", default="8,4", help="num_warps of the persistent kernel to try")
    parser.add_argument("--split-t", default="64,32", help="cache rows per attention split to try")
    parser.add_argument("--modes", default="half,layer",
                        help="half (attention half), layer (whole layer), hybrid (the persistent half, then the "
                             "engine's gate_up, down and reduce launches)")
    parser.add_argument("--programs", default="128,132",
                        help="programs of a whole layer (128 run qkv; more join the MLP stages only)")
    parser.add_argument("--device", default="cuda",
                        help="cpu: a check of the plumbing, no timing (TRITON_INTERPRET=1, stages one by one)")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16, or float32 for an exact check on the CPU")
    parser.add_argument("--resources", action="store_true",
                        help="only compile the kernel for sm_90 (no GPU needed) and print its registers")
    args = parser.parse_args()
    if args.resources:
        os.environ.pop("TRITON_INTERPRET", None)
        print_table([h200_resources(int(w), args.context, int(t), mode == "layer", trace)
                     for mode in args.modes.split(",") for t in args.split_t.split(",")
                     for w in args.warps.split(",") for trace in (False, True)])
        print("(the programs' count changes no constexpr: the same kernel at 128 and 132)")
        return

    dev = torch.device(args.device)
    on_gpu = dev.type == "cuda"
    if not on_gpu and not interpreting():
        raise SystemExit("--device cpu runs the kernel in the interpreter: set TRITON_INTERPRET=1")
    config = preset("qwen2.5-1.5b", num_layers=args.layers)
    if on_gpu:
        fused.enable_fusion()
        enable_invariant_kernel()
    dtype = getattr(torch, args.dtype)
    model = build_model(config, args.device, dtype)
    L, pos = config.num_layers, args.context
    cache = KVCache(config, pos + 64, dev, dtype)
    for k, v in zip(cache.keys, cache.values):
        k.normal_()
        v.normal_()
    model.setup_rope(cache.max_len)
    tokens = torch.tensor([[17]], device=dev)
    start = torch.tensor([pos], device=dev)
    positions, seq_len, cos, sin, hidden0, normed0 = step_inputs(
        tokens, start, model.embed_tokens.weight, model.rope_cos, model.rope_sin,
        model.layers[0].input_layernorm.weight)

    def chain(layers, mode):
        """The engine's own launches: the attention half (qkv, split, merge, o) or whole layers."""
        hidden, normed = hidden0, normed0
        for i in layers:
            layer = model.layers[i]
            nxt = model.layers[(i + 1) % L].input_layernorm
            if mode == "layer":
                hidden, normed = layer(hidden, normed, nxt, cos, sin, cache, i, pos, positions, True, seq_len, None)
                continue
            attn = layer.self_attn(hidden, layer.input_layernorm, cos, sin, cache, i, pos, positions, True, seq_len,
                                   None, normed_inputs=normed)
            hidden, normed = fused_project(attn, layer.self_attn.o_proj, residual=hidden, emit_norm=nxt, settled=True)
        return hidden

    counters = torch.zeros(L, config.num_kv_heads + 3, device=dev, dtype=torch.int32)
    stuck = torch.zeros(1, device=dev, dtype=torch.int32)

    def layers_for(mode, split_t, warps, programs):
        out = []
        for i, layer in enumerate(model.layers):
            att, nxt = layer.self_attn, model.layers[(i + 1) % L].input_layernorm.weight
            mlp = (layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight, nxt) if mode == "layer" else None
            emit = layer.post_attention_layernorm.weight if mode != "half" else nxt
            out.append(PersistentLayer(
                att.qkv_proj.weight, att.qkv_proj.bias, att.o_proj.weight, emit, cache.keys[i][0], cache.values[i][0],
                counters[i], num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                eps=layer.input_layernorm.eps, context=pos, mlp=mlp, programs=programs if mlp else None,
                split_t=split_t, num_warps=warps))
        return out

    def persistent(kernels, layers, trace=None, hybrid=False):
        counters.zero_()
        x, sumsq, h = normed0.weighted.view(-1), normed0.sumsq.view(-1), hidden0.view(-1)
        for i in layers:
            stages = (0,) if on_gpu else (1, 2, 3, 4, 5) if kernels[i].mlp else (1, 2, 3)
            h, x, sumsq = kernels[i].run(x, sumsq, h, cos, sin, stuck, stages=stages,
                                         trace=None if trace is None else trace[i])
            if hybrid:   # the engine's own MLP launches after the persistent attention half
                post = type(normed0)(x.view(hidden0.shape), sumsq.view(-1, 1))
                hidden, normed = model.layers[i].fused_mlp(h.view(hidden0.shape), post,
                                                           model.layers[(i + 1) % L].input_layernorm)
                h, x, sumsq = hidden.view(-1), normed.weighted.view(-1), normed.sumsq.view(-1)
        return h

    bandwidth = copy_bandwidth() if on_gpu else float("nan")

    def floor_us(mode) -> float:
        """The layer's (or half's) weight and KV bytes at the copy bandwidth measured in this run."""
        layer = model.layers[0]
        weights = [layer.self_attn.qkv_proj.weight, layer.self_attn.qkv_proj.bias, layer.self_attn.o_proj.weight]
        if mode == "layer":
            weights += [layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight]
        kv = 2 * (pos + 1) * cache.keys[0][0, :, 0].numel() * cache.keys[0].element_size()
        return (sum(w.numel() * w.element_size() for w in weights) + kv) / bandwidth * 1e6

    h_in = hidden0.view(-1).float()
    rows = []
    for mode in args.modes.split(","):
        # one layer each way on the same inputs: what the layer adds to the stream agrees to rounding
        chain_mode = "layer" if mode == "hybrid" else mode
        hybrid = mode == "hybrid"
        ref_delta = chain([0], chain_mode).view(-1).float() - h_in
        t_chain = graph_replay_time(lambda: chain(range(L), chain_mode)) / L if on_gpu else float("nan")
        floor = floor_us(chain_mode)
        rows.append({"path": f"engine chain, {MODES[mode]}", "us per layer": round(t_chain * 1e6, 2),
                     "floor us": round(floor, 2), "% of floor": round(100 * floor / (t_chain * 1e6), 1),
                     "x chain": 1.0})
        programs_tried = [int(p) for p in args.programs.split(",")] if mode == "layer" else [None]
        variants = [(t, w, p) for t in (int(v) for v in args.split_t.split(","))
                    for w in (int(v) for v in args.warps.split(",")) for p in programs_tried]
        for split_t, warps, programs in variants:
            kernels = layers_for(mode, split_t, warps, programs)
            stuck.zero_()
            got_delta = persistent(kernels, [0], hybrid=hybrid).float() - h_in
            err = ((got_delta - ref_delta).norm() / ref_delta.norm()).item()
            label = (f"persistent {mode}, {pos // split_t} splits, {warps} warps"
                     + (f", {kernels[0].programs} programs" if programs else ""))
            if not on_gpu:
                print(f"{label}: the layer's delta against the engine's, rel err {err:.1e}")
                continue
            if stuck.item():   # a deadlock: timing it would take minutes of waits giving up
                rows.append({"path": label, "delta rel err": f"{err:.1e}", "gave up": int(stuck.item())})
                print(rows[-1], file=sys.stderr, flush=True)
                continue
            t = graph_replay_time(lambda: persistent(kernels, range(L), hybrid=hybrid)) / L
            trace = torch.zeros(L, kernels[0].programs, TRACE_COLUMNS, device=dev, dtype=torch.int64)
            graph_replay_time(lambda: persistent(kernels, range(L), trace, hybrid=hybrid), repeats=3)
            rows.append({"path": label, "us per layer": round(t * 1e6, 2), "floor us": round(floor, 2),
                         "% of floor": round(100 * floor / (t * 1e6), 1), "x chain": round(t_chain / t, 3),
                         "delta rel err": f"{err:.1e}", "gave up": int(stuck.item()),
                         **stage_medians(trace.cpu())})
            print(rows[-1], file=sys.stderr, flush=True)
    if not on_gpu:
        return
    columns = {key: None for row in rows for key in row}
    print(f"qwen2.5-1.5b decode, {L} layers, context {pos}, batch 1, copy bandwidth {bandwidth / 1e12:.2f} TB/s "
          "(floor: weight + KV bytes at that rate); stage columns: us from the previous layer's last program end")
    print_table([{**columns, **row} for row in rows])


MODES = {"half": "attention half (qkv, split, merge, o)", "layer": "whole layer (+ gate_up, down, reduce)",
         "hybrid": "whole layer (+ gate_up, down, reduce)"}


def h200_resources(num_warps: int, context: int = 512, split_t: int = 64, mlp: bool = False,
                   trace: bool = False) -> dict:
    """Registers, spills and shared memory of the GPU path (STAGE 0, PDL) at the Qwen2.5-1.5B shape,
    compiled for sm_90 here, with no GPU (as bench/kernel_resources.py does for small_linear)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from bench.kernel_resources import cuobjdump

    fn = _persistent_layer
    pointers = dict(X="*bf16", SumSqIn="*fp32", Res="*bf16", Wqkv="*bf16", Bqkv="*bf16", Wo="*bf16",
                    ONormW="*bf16", Wgu="*bf16", Wdown="*bf16", DownNormW="*bf16", HMid="*bf16", XMid="*bf16",
                    SumSqMid="*fp32", Act="*bf16", Cos="*fp32", Sin="*fp32", KCache="*bf16", VCache="*bf16", Q="*bf16",
                    OPart="*fp32", MPart="*fp32", LPart="*fp32", Counters="*i32", Stuck="*i32", Out="*bf16",
                    WeightedOut="*bf16", SumSqOut="*fp32", Trace="*i64")
    consts = dict(HID=1536, KC=512, HQ=12, HKV=2, D=128, SPLITS=context // split_t, SPLIT_T=split_t, G_P2=16,
                  PARTS_P2=128, O_PARTS_P2=128, MLP=mlp, INTER=8960, GU_TILES=9, DKC=512, DOWN_CHUNKS=18,
                  STAGE=0, UPCAST_DOT=False, DOT_PRECISION="tf32", USE_PDL=True, TRACE=trace)
    signature = {name: "constexpr" if name in consts else pointers.get(name, "fp32" if name in ("eps", "scale_log2e")
                                                                        else "i32") for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in pointers}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    usage = cuobjdump(kernel.asm["cubin"], "-res-usage")
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    return dict(mlp=mlp, split_t=split_t, warps=num_warps, trace=trace, regs=regs, spill_stack_bytes=int(re.search(r"STACK:(\d+)", usage).group(1)),
                shared_kb=round(kernel.metadata.shared / 1024, 1),
                ctas_per_sm=65536 // (-(-regs // 8) * 8 * num_warps * 32))


def stage_medians(trace: torch.Tensor) -> dict:
    """Per column, over the middle layers' medians, us from the previous layer's last END: when the
    programs that reached it did (the median for a "waited" column, the last one for the others)."""
    out = {}
    for c, name in enumerate(COLUMN_NAMES[1:-1], start=1):
        values = []
        for i in range(2, trace.shape[0] - 1):
            t0 = int(trace[i - 1, :, int(END.value)].max())
            reached = trace[i, :, c][trace[i, :, c] != 0]
            if reached.numel():
                us = (reached.double() - t0) / 1e3
                values.append((us.median() if "waited" in name else us.max()).item())
        if values:
            out[name] = round(statistics.median(values), 2)
    return out


if __name__ == "__main__":
    main()
