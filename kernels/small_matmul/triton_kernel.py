"""Batch-invariant small-M linear in Triton: fixed row tiles, split-K at shape-only boundaries.

Program (m block, n block, k split) multiplies a BLOCK_M x [k range] tile of x by a BLOCK_N x
[k range] tile of the weight with tl.dot, float32 accumulation, walking its k range in BLOCK_K steps
in increasing order. BLOCK_M is always 16 whatever M is (rows past M are masked to zero), so a row
goes through the same instructions whether it is alone or one of 17, in any position of its tile;
M enters only as a mask bound and as the number of m blocks (M = 17..32 runs a second m block, the
same code). The k splits are cut at multiples of BLOCK_K that depend on (N, K) only; with more than
one split the float32 partials go to a [splits, M, N] buffer and a second kernel sums them in split
order 0, 1, 2, ... (no atomics), adds the bias and casts. (Summing them in the split kernel, by the
last program of a tile to arrive on an atomic counter, measured slower: its fence, atomic and
serial loads cost more than a launch under PDL; docs/performance.md.) One config per (N, K, dtype): a table
measured on an H200 (bench/small_matmul.py --tune), a heuristic elsewhere; never autotuned per call.

Under programmatic dependent launch a program requests its first `preload` weight tiles before
griddepcontrol.wait: weights do not depend on the previous kernel, so their first memory round
trip overlaps that kernel's tail (at batch 1 the small projections are all ramp and tail). With
`settled=True` the epilogue's inputs written two or more launches back (rope rows, positions, and in
the reduce the residual; the constants bias and norm weight with them) are read there too
(kernels._pdl, "Settled inputs"; +4% decode at Qwen2.5-1.5B with the attention's, docs/performance.md "Stop 12").

A gemv config (`gemv=True`, docs/performance.md "Stop 13") replaces the tl.dot loop with
block_n whole weight rows per program, loaded before the wait into registers and multiplied on the
CUDA cores, one row of x after the other: more programs for a small weight (Qwen2.5-1.5B's o: 192
instead of 96), same epilogues, the same code for every row whatever M is.

SWAP computes out^T = W x^T (the weight as the MMA's A operand, BLOCK_N its M side), which lets
Hopper use wgmma with the 16 rows of x as its narrow N side; SWAP=False computes x W^T.

Nothing syncs the host; outputs come from torch.empty, so a call can be captured in a CUDA graph.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from batchd.kernels._backend import (early_reads_enabled, interpreting, launch_options, multiprocessor_count,
                              patch_interpreter_index, pdl_enabled, pdl_trigger_point)
from batchd.kernels._pdl import AFTER_WAIT, pdl_trigger, pdl_wait
from batchd.kernels._trace import END, START, WAITED, trace_args, trace_mark
from batchd.kernels.rope_cache.triton_kernel import rope_rows_at, rotate_with

BLOCK_M = 16
REDUCE_BLOCK = 1024

if interpreting():
    patch_interpreter_index()


@dataclass(frozen=True)
class SmallLinearConfig:
    block_n: int
    block_k: int
    splits: int            # requested k splits; the effective count is effective_splits(K)
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = True
    preload: int = 0       # k steps of weight tiles requested before griddepcontrol.wait (0..4)
    gemv: bool = False     # block_n whole weight rows per program on the CUDA cores (see _gemv_rows)
    trigger: int | None = None   # this weight's PDL trigger point, 0, 1 or 2 (kernels._pdl); None: the
                                 # "linear" knob's (kernels._backend.pdl_trigger_point)
    stream: bool = False   # run kernels.stream_linear (bulk-copy weight ring, one CTA per SM) instead
    ring_kb: int = 192     # its ring of shared-memory slots, in KB
    stream_ctas: int = 1   # its CTAs per SM (1 or 2)
    stream_min_kb: int = 0   # its shared memory request at least this (KB): past 113 KB no two of its
                             # CTAs share an SM
    stream_max_ctas: int = 0   # at most this many CTAs (0: one per SM, or stream_ctas)
    reduce_trigger: int | None = None   # its k split's reduce's PDL trigger point, 0, 1 or 2; None:
                                        # the "reduce" knob's. 0 lets the next launch start while
                                        # this split kernel still runs (see __post_init__)
    skip_wait: bool = False  # a what-if for bench/step_sweep.py only: no griddepcontrol.wait, so the
                             # kernel reads its input while the kernel before still writes it (wrong
                             # results). Its tok/s overstates what any real handoff could gain: the
                             # kernel then overlaps all of the one before (docs/performance.md, "Stop 30")

    def __post_init__(self):
        # 0 runs launches two deep: the launch after this one may start while the one before it
        # runs. A table entry takes it only where that next launch reads early nothing the launch
        # before this one writes (kernels._pdl, "Settled inputs"): in a decode layer, o (its
        # predecessor, the attention merge, writes only what o reads) before gate_up (which reads
        # nothing early), so that gate_up's weight ring fills while o runs. A reduce always may: the
        # split kernel before it writes only the partials, which nothing but the reduce reads.
        for name in ("trigger", "reduce_trigger"):
            if getattr(self, name) not in (None, 0, 1, 2):
                raise ValueError(f"a config's {name.replace('_', ' ')} point is 0, 1 or 2 (kernels._pdl), "
                                 f"got {getattr(self, name)}")
        if (self.stream_min_kb or self.stream_max_ctas) and not self.stream:
            raise ValueError("stream_min_kb and stream_max_ctas shape a stream launch: set stream=True")
        if self.stream_min_kb < 0 or self.stream_max_ctas < 0:
            raise ValueError(f"stream_min_kb and stream_max_ctas are >= 0 (0: no bound), got "
                             f"{self.stream_min_kb}, {self.stream_max_ctas}")

    def preload_steps(self, K: int) -> int:
        """`preload`, capped by the k steps of the shortest (last) split (0 for a gemv: its rows are
        all loaded before the wait)."""
        if self.gemv:
            return 0
        return max(0, min(self.preload, self.split_k_steps(K)[1], 4))

    def k_per_split(self, K: int) -> int:
        """Columns of K per split, a multiple of block_k (depends on K only); a gemv never splits."""
        if self.gemv:
            return triton.cdiv(K, self.block_k) * self.block_k
        k_blocks = triton.cdiv(K, self.block_k)
        return triton.cdiv(k_blocks, max(1, min(self.splits, k_blocks))) * self.block_k

    def effective_splits(self, K: int) -> int:
        return triton.cdiv(K, self.k_per_split(K))

    def split_k_steps(self, K: int) -> tuple[int, int]:
        """(k steps of a full split, k steps of the last one)."""
        per_split = triton.cdiv(self.k_per_split(K), self.block_k)
        return per_split, triton.cdiv(K, self.block_k) - (self.effective_splits(K) - 1) * per_split


# Qwen2.5-1.5B's gate_up runs on kernels.stream_linear (128 KB ring) since stop 25: 858 against the
# Triton tiles' 836 tok/s, once its folded norm's parts were loaded in flight together (docs/performance.md,
# "Stop 25"); off sm_90 or in f32 that entry falls back to the heuristic (choose_config). Since stop 26
# its q/k/v projection (rope and cache write fused) streams too, and down's reduce signals before its
# wait, so that qkv's CTAs start and fill their 96 KB rings while down still runs: 895 against 864
# tok/s (docs/performance.md, "Stop 26"; without the early reduce trigger the stream qkv gains nothing, and the
# Triton qkv with it loses: 800). Where stream kernels cannot run, the reduce keeps the knob's point.
# Stop 27: that qkv's 100 KB CTAs landed two to an SM on 79 SMs (its dot products then share the
# SM's issue slots: 1.6 us for 0.5); asking 114 KB keeps one a SM, and 128 CTAs (two 24 KB chunks
# each) leave the 4 SMs that down frees last: 918 against 907 tok/s (docs/performance.md, "Stop 27").
# Measured on one H200 (132 SMs, copy bandwidth 4.27 TB/s) by `python bench/small_matmul.py --tune`,
# bf16 at M = 1, weights streamed from HBM; f16 uses the bf16 entry (same bytes). `preload` from
# `python bench/step_sweep.py` (preload=) on whole decode steps: it pays on weights of 100 MB and more
# (Llama-3-8B 226 -> 234 tok/s) and on Qwen2.5-1.5B's down (730 -> 736), and is neutral or costs
# 1-2% on the other small ones, which are latency-bound. Narrow 16-row weight tiles win for the
# small projections (more programs without a k split and its reduce launch). The Qwen2.5-1.5B
# entries and Llama-3-8B's down were then re-chosen on whole decode steps, where launches overlap
# (`bench/step_sweep.py` N,K= specs): a kernel's best config alone is not its best in a step (1.5B
# down: 11 splits alone, 8 with preload in steps, 703 -> 747 tok/s). Every variant tried and its
# tok/s: docs/performance.md, "Stop 10". Stop 16 re-measured on interleaved whole steps (the first run of a
# process reads fast, which had hidden both): Qwen2.5-1.5B's qkv in 16x256 tiles (828 against 820
# tok/s) and its down in 10 splits (840 against 829); docs/performance.md "Stop 16". Key: (N, K, element size).
TUNED: dict[tuple[int, int, int], SmallLinearConfig] = {
    # Qwen2.5-1.5B
    (2048, 1536, 2): SmallLinearConfig(16, 256, 1, stream=True, ring_kb=96, stream_min_kb=114,
                                       stream_max_ctas=128),                                   # qkv (stop 26, 27)
    (1536, 1536, 2): SmallLinearConfig(8, 128, 1, num_warps=4, gemv=True),                     # o (stop 13)
    (17920, 1536, 2): SmallLinearConfig(16, 128, 1, stream=True, ring_kb=128),                 # gate_up (stop 25)
    (1536, 8960, 2): SmallLinearConfig(64, 128, 10, num_warps=4, num_stages=3, swap=True, preload=2,
                                       reduce_trigger=0),                                      # down (stop 16, 26)
    (151936, 1536, 2): SmallLinearConfig(64, 128, 1, num_warps=4, num_stages=3, swap=True),    # lm_head
    # Llama-3-8B
    (6144, 4096, 2): SmallLinearConfig(64, 128, 1, num_warps=4, num_stages=4, swap=True),      # qkv
    (4096, 4096, 2): SmallLinearConfig(32, 256, 1, num_warps=4, num_stages=4, swap=True),      # o
    (28672, 4096, 2): SmallLinearConfig(64, 128, 1, num_warps=4, num_stages=4, swap=True, preload=4),   # gate_up
    (4096, 14336, 2): SmallLinearConfig(64, 128, 4, num_warps=4, num_stages=4, swap=True, preload=4),   # down
    (128256, 4096, 2): SmallLinearConfig(64, 128, 1, num_warps=4, num_stages=4, swap=True, preload=4),  # lm_head
}


def heuristic_config(N: int, K: int, dtype: torch.dtype, sms: int) -> SmallLinearConfig:
    """For shapes outside the table, following what the table's measurements showed: weights up to
    16 MiB in 16-row tiles with no split; larger ones in 64-row tiles, split over K only when there
    are fewer 64-row blocks than multiprocessors (to about two programs per multiprocessor)."""
    size = dtype.itemsize
    if N * K * size <= (16 << 20):
        return SmallLinearConfig(16, 512 // size, 1, num_warps=4, num_stages=4, swap=True)
    block_k = 256 // size
    n_blocks = triton.cdiv(N, 64)
    k_blocks = triton.cdiv(K, block_k)
    splits = 1 if n_blocks >= sms else max(1, min(k_blocks, triton.cdiv(2 * sms, n_blocks)))
    return SmallLinearConfig(64, block_k, splits, num_warps=4, num_stages=4 if size <= 2 else 3, swap=True)


def choose_config(N: int, K: int, dtype: torch.dtype, device: torch.device, *, gated: bool = False
                  ) -> SmallLinearConfig:
    """The one config for (N, K, dtype) on `device`: the tuned table on CUDA, else the heuristic.
    Gated (N outputs from a [2N, K] gate/up weight): the [2N, K] entry as it is (a tile of block_n
    weight rows is block_n / 2 gate rows and the matching up rows), never a k split (silu needs
    the whole sum)."""
    rows = 2 * N if gated else N
    config = None
    if device.type == "cuda" and dtype.itemsize == 2:
        config = TUNED.get((rows, K, 2))
    if config is None:
        config = heuristic_config(rows, K, dtype, multiprocessor_count(device))
    streams = stream_runs(device, dtype) if config.stream or config.reduce_trigger == 0 else False
    if config.stream and not streams:
        config = heuristic_config(rows, K, dtype, multiprocessor_count(device))
    if config.reduce_trigger == 0 and not streams:
        # the early trigger pays only for a stream kernel after the reduce, which fills its weight ring
        # while this projection runs; a Triton projection there lost (docs/performance.md, "Stop 26")
        config = dataclasses.replace(config, reduce_trigger=None)
    if gated:
        config = dataclasses.replace(config, block_n=max(32, config.block_n), splits=1)
    return config


def stream_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a `stream=True` config can run here: kernels.stream_linear on an sm_90+ GPU, bf16/f16."""
    from batchd.kernels.stream_linear import cuda_supported

    return not interpreting() and dtype in (torch.bfloat16, torch.float16) and cuda_supported(device)


class RopeTarget(NamedTuple):
    """Where the q/k/v projection of a decode step puts its rows when rope is fused into it."""
    cos: torch.Tensor           # [T, D] float32, "rotate half" tables at the rows' positions
    sin: torch.Tensor           # [T, D] float32
    positions: torch.Tensor     # [T] int64 cache rows
    k_cache: torch.Tensor       # [B, Hkv, S_max, D]
    v_cache: torch.Tensor       # [B, Hkv, S_max, D]
    num_heads: int
    num_kv_heads: int


def rope_fits(config: SmallLinearConfig, N: int, K: int, head_dim: int) -> bool:
    """Rope goes into the projection's epilogue when a program's tile holds whole rope pairs of one
    head (block_n / 2 divides D / 2) and there is no k split (the rotation needs the whole sum); on
    kernels.stream_linear (a stream config) wherever the rows are whole heads of an even D."""
    if config.stream:
        return head_dim % 2 == 0 and N % head_dim == 0
    half = config.block_n // 2
    return config.effective_splits(K) == 1 and half >= 1 and (head_dim // 2) % half == 0 and N % config.block_n == 0


@triton.jit
def _load_weight_tile(w_ptrs, k0, K, n_ok, offs_k, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at column k0 (streamed once: evict first)."""
    if EVEN_K:
        if EVEN_N:
            w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs + k0, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
    else:
        k_ok = (k0 + offs_k) < K
        w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
    return w


@triton.jit
def _accumulate(acc, w, x_ptrs, k0, K, m_ok, offs_k, EVEN_K: tl.constexpr, SWAP: tl.constexpr,
                UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc += the product of weight tile w with x's [BLOCK_M, BLOCK_K] tile at column k0."""
    if EVEN_K:
        x = tl.load(x_ptrs + k0, mask=m_ok[:, None], other=0.0)
    else:
        x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & ((k0 + offs_k) < K)[None, :], other=0.0)
    if UPCAST_DOT:
        x = x.to(tl.float32)
        w = w.to(tl.float32)
    if SWAP:
        acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)        # [BLOCK_N, BLOCK_M]
    else:
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)        # [BLOCK_M, BLOCK_N]
    return acc


@triton.jit(do_not_specialize=["M", "trace_row"])
def _small_linear_kernel(
    X, W, Bias, Res, Out, Part, SumSqIn, NextNormW, WeightedOut, SumSqOut, Cos, Sin, Pos, QOut, KCache, VCache,
    # X [M, K]; W [N, K] ([2N, K]: gate rows, then up rows, when GATED); Bias [N]; Res, Out [M, N];
    # Part [SPLITS, M, N] f32; SumSqIn [parts_in, M] f32; NextNormW [N]; WeightedOut [M, N];
    # SumSqOut [N / OUT_N, M] f32; with ROPE: Cos, Sin [T, D] f32, Pos [T] int64, QOut [B, Hq, T, D],
    # KCache, VCache [B, Hkv, S_max, D] (rows m = b * T + t)
    M, N, K, eps, parts_in, T,
    stride_xm, stride_wn, stride_rm, stride_om,
    stride_qb, stride_qh, stride_qt, stride_cb, stride_ch, stride_cn,
    k_per_split,               # multiple of BLOCK_K
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, SWAP: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SCALE_ROWS: tl.constexpr, PARTS_P2: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
    EMIT_NORM: tl.constexpr, USE_PDL: tl.constexpr, TRIGGER: tl.constexpr, PRELOAD: tl.constexpr,
    EARLY: tl.constexpr, ROPE: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
    GEMV: tl.constexpr, K_P2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    Trace, trace_row, TRACE: tl.constexpr,       # kernels._trace
    SKIP_WAIT: tl.constexpr = False,             # SmallLinearConfig.skip_wait (a what-if: wrong results)
):
    """Nothing but loads feeds tl.dot, so Triton pipelines both operands (an elementwise op on x
    in the loop costs a full memory round trip per k step: bench/fused_linear.py measured 2x).

    EARLY: the epilogue's inputs (bias, next norm weight, rope rows and positions) are read before
    griddepcontrol.wait, the caller having promised they were written two or more launches back
    (kernels._pdl, "Settled inputs"); without it they are read after the k loop. The residual is
    read after the loop either way (the reduce kernel reads it early). The same bits either way."""
    tl.static_assert(BLOCK_M >= 16)
    tl.static_assert(BLOCK_K % 16 == 0)
    tl.static_assert(not (GATED and SPLIT))
    tl.static_assert(PRELOAD <= 4)
    tl.static_assert(not (ROPE and (SPLIT or GATED)))
    tl.static_assert(not (GEMV and (SPLIT or GATED or PRELOAD > 0 or not SWAP)))
    OUT_N: tl.constexpr = BLOCK_N // 2 if GATED else BLOCK_N     # output columns per program
    HALF_N: tl.constexpr = BLOCK_N // 2
    HALF_D: tl.constexpr = HEAD_DIM // 2
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.arange(0, BLOCK_N)
    if ROPE:
        # tile rows [0, HALF_N) are dims d of one head, rows [HALF_N, BLOCK_N) their rope partners
        # d + D/2 (the host keeps HALF_N a divisor of D/2, so a tile never spans two heads)
        pair = pid_n * HALF_N + j % HALF_N           # head * D/2 + d
        col = (pair // HALF_D) * HEAD_DIM + (j // HALF_N) * HALF_D + pair % HALF_D
        w_row = col
    else:
        col = pid_n * OUT_N + j % OUT_N              # output column of weight-tile row j
        w_row = (j // OUT_N) * N + col               # gated: rows [0, OUT_N) gate, [OUT_N, BLOCK_N) up
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = col < N
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)

    trace_mark(Trace, trace_row, START, TRACE)
    pdl_trigger(USE_PDL, TRIGGER, 0)
    w_ptrs = W + w_row[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    # The first PRELOAD weight tiles never depend on the previous kernel: they are requested before
    # griddepcontrol.wait, so under programmatic dependent launch their memory round trip overlaps
    # that kernel's tail. (The host keeps PRELOAD within every split's k range.)
    if PRELOAD >= 1:
        w0 = _load_weight_tile(w_ptrs, k_start, K, n_ok, offs_k, EVEN_N, EVEN_K)
    if PRELOAD >= 2:
        w1 = _load_weight_tile(w_ptrs, k_start + BLOCK_K, K, n_ok, offs_k, EVEN_N, EVEN_K)
    if PRELOAD >= 3:
        w2 = _load_weight_tile(w_ptrs, k_start + 2 * BLOCK_K, K, n_ok, offs_k, EVEN_N, EVEN_K)
    if PRELOAD >= 4:
        w3 = _load_weight_tile(w_ptrs, k_start + 3 * BLOCK_K, K, n_ok, offs_k, EVEN_N, EVEN_K)
    if GEMV:
        # the program's BLOCK_N whole weight rows [BLOCK_N, K_P2], requested before the wait (held in
        # registers: the host keeps K_P2 <= 2048; K in chunks without the power-of-2 padding measured
        # slower in whole steps, docs/performance.md "Stop 13")
        offs_kk = tl.arange(0, K_P2)
        w_rows = tl.load(W + w_row[:, None].to(tl.int64) * stride_wn + offs_kk[None, :],
                         mask=n_ok[:, None] & (offs_kk < K)[None, :], other=0.0, eviction_policy="evict_first")
    if GATED:
        cols = pid_n * OUT_N + tl.arange(0, OUT_N)
    elif ROPE:
        cols = col
    else:
        cols = pid_n * BLOCK_N + j
    mask = (cols < N)[:, None] & m_ok[None, :]
    if EARLY:
        bias, next_nw, rope_rows = _epilogue_inputs(cols, pid_n * HALF_N, offs_m, m_ok, N, T, Bias, NextNormW, Cos,
                                                    Sin, Pos, KCache, HAS_BIAS, EMIT_NORM, ROPE, SPLIT, HEAD_DIM,
                                                    HALF_N)
    if SKIP_WAIT:
        pdl_trigger(USE_PDL, TRIGGER, 1)
    else:
        pdl_wait(USE_PDL, TRIGGER)               # X, SumSqIn, Res: from the previous kernel
    trace_mark(Trace, trace_row, WAITED, TRACE)

    if SCALE_ROWS:
        # X held norm_weight * h: RMSNorm's per-row scale, from the sums of squares of h that the
        # kernel producing h left in SumSqIn (parts summed in a fixed order). Read before the k loop
        # so its round trip overlaps the loop's instead of following it; applied after the loop.
        parts = tl.arange(0, PARTS_P2)
        sumsq = tl.load(SumSqIn + parts[:, None] * M + offs_m[None, :],
                        mask=(parts < parts_in)[:, None] & m_ok[None, :], other=0.0)
        row_scale = tl.rsqrt(tl.sum(sumsq, 0) / K + eps)             # [BLOCK_M]
    x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if GEMV:
        acc = _gemv_rows(acc, w_rows, X, pid_m * BLOCK_M, M, K, stride_xm, K_P2, BLOCK_M)
    else:
        # k steps in increasing order whether preloaded or not: the same sums, bit for bit
        if PRELOAD >= 1:
            acc = _accumulate(acc, w0, x_ptrs, k_start, K, m_ok, offs_k, EVEN_K, SWAP, UPCAST_DOT, DOT_PRECISION)
        if PRELOAD >= 2:
            acc = _accumulate(acc, w1, x_ptrs, k_start + BLOCK_K, K, m_ok, offs_k, EVEN_K, SWAP, UPCAST_DOT,
                              DOT_PRECISION)
        if PRELOAD >= 3:
            acc = _accumulate(acc, w2, x_ptrs, k_start + 2 * BLOCK_K, K, m_ok, offs_k, EVEN_K, SWAP, UPCAST_DOT,
                              DOT_PRECISION)
        if PRELOAD >= 4:
            acc = _accumulate(acc, w3, x_ptrs, k_start + 3 * BLOCK_K, K, m_ok, offs_k, EVEN_K, SWAP, UPCAST_DOT,
                              DOT_PRECISION)
        for k0 in range(k_start + PRELOAD * BLOCK_K, k_end, BLOCK_K):
            w = _load_weight_tile(w_ptrs, k0, K, n_ok, offs_k, EVEN_N, EVEN_K)
            acc = _accumulate(acc, w, x_ptrs, k0, K, m_ok, offs_k, EVEN_K, SWAP, UPCAST_DOT, DOT_PRECISION)
    pdl_trigger(USE_PDL, TRIGGER, 2)
    if not SWAP:
        acc = tl.trans(acc)                           # [BLOCK_N, BLOCK_M] from here on

    if SCALE_ROWS:
        acc = acc * row_scale[None, :]

    if not EARLY:
        bias, next_nw, rope_rows = _epilogue_inputs(cols, pid_n * HALF_N, offs_m, m_ok, N, T, Bias, NextNormW, Cos,
                                                    Sin, Pos, KCache, HAS_BIAS, EMIT_NORM, ROPE, SPLIT, HEAD_DIM,
                                                    HALF_N)
    if ROPE:
        if HAS_BIAS:
            acc += bias[:, None]
        _rope_epilogue(acc, pid_n * HALF_N, offs_m, m_ok, T, rope_rows, QOut, KCache, VCache,
                       stride_qb, stride_qh, stride_qt, stride_cb, stride_ch, stride_cn,
                       HQ, HKV, HEAD_DIM, HALF_N, BLOCK_M)
    elif SPLIT:
        tl.store(Part + (pid_s * M + offs_m[None, :]) * N + cols[:, None], acc, mask=mask)
    elif GATED:
        gate, up = tl.split(tl.permute(tl.reshape(acc, [2, OUT_N, BLOCK_M]), [1, 2, 0]))   # [OUT_N, BLOCK_M]
        _epilogue(acc, gate, up, cols, offs_m, mask, pid_n, M, bias, Res, next_nw, Out, WeightedOut, SumSqOut,
                  stride_rm, stride_om, True, HAS_BIAS, RESIDUAL, EMIT_NORM)
    else:
        _epilogue(acc, acc, acc, cols, offs_m, mask, pid_n, M, bias, Res, next_nw, Out, WeightedOut, SumSqOut,
                  stride_rm, stride_om, False, HAS_BIAS, RESIDUAL, EMIT_NORM)
    trace_mark(Trace, trace_row, END, TRACE)


@triton.jit
def _gemv_rows(acc, w_rows, X, m0, M, K, stride_xm, K_P2: tl.constexpr, BLOCK_M: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] with column r = w_rows [BLOCK_N, K_P2] times x row m0 + r, on the CUDA
    cores: float32 products summed over k by one tl.sum in a fixed layout, row after row. A row's
    sum is the same code whatever M is (batch-invariant), and the program holds its weight rows in
    registers for all of them. At batch 1 this streams a small weight from many programs, a few
    rows each, where the tl.dot tiles (16 weight rows at least) leave it to fewer programs with
    fewer bytes in flight (docs/performance.md, "Stop 13")."""
    offs_kk = tl.arange(0, K_P2)
    lane = tl.arange(0, BLOCK_M)
    w = w_rows.to(tl.float32)
    for r in range(0, tl.minimum(BLOCK_M, M - m0)):
        x = tl.load(X + (m0 + r) * stride_xm + offs_kk, mask=offs_kk < K, other=0.0).to(tl.float32)
        y = tl.sum(w * x[None, :], 1)                                   # [BLOCK_N]
        acc = tl.where((lane == r)[None, :], y[:, None], acc)
    return acc


@triton.jit
def _epilogue_inputs(cols, first_pair, offs_m, m_ok, N, T, Bias, NextNormW, Cos, Sin, Pos, KCache,
                     HAS_BIAS: tl.constexpr, EMIT_NORM: tl.constexpr, ROPE: tl.constexpr, SPLIT: tl.constexpr,
                     HEAD_DIM: tl.constexpr, HALF_N: tl.constexpr):
    """What the epilogue reads besides the sums and the residual, for the output columns `cols` and
    rows `offs_m`: (bias [cols] f32, next norm weight [cols] f32, rope rows). An input a config does
    not use comes back as 0.0. With ROPE, rope rows = (cos1, cos2, sin1, sin2 [HALF_N, rows] for
    dims d and d + D/2 of the tile's head, positions [rows]); those loads may run before
    griddepcontrol.wait (EARLY) and skip L1 (".cg").

    The residual is not among them: `_epilogue` reads it after the k loop even when it is settled.
    Read before the wait it moved the compiled epilogue's layout, and with it the order of the
    emitted sums of squares (the o projection's bits changed on the H200, for no gain:
    docs/performance.md "Stop 12")."""
    bias = 0.0
    next_nw = 0.0
    rope_rows = 0.0
    if not SPLIT:                  # a k split adds them in the reduce kernel
        if HAS_BIAS:
            bias = tl.load(Bias + cols, mask=cols < N, other=0.0).to(tl.float32)
        if EMIT_NORM:
            next_nw = tl.load(NextNormW + cols, mask=cols < N, other=0.0).to(tl.float32)
    if ROPE:
        HALF_D: tl.constexpr = HEAD_DIM // 2
        d = (first_pair % HALF_D + tl.arange(0, HALF_N))[:, None]           # [HALF_N, 1]
        t = offs_m % T
        cos1, cos2, sin1, sin2 = rope_rows_at(Cos + t[None, :] * HEAD_DIM + d, Sin + t[None, :] * HEAD_DIM + d,
                                              HALF_D, m_ok[None, :], KCache.dtype.element_ty)
        pos = tl.load(Pos + t, mask=m_ok, other=0, cache_modifier=".cg")
        rope_rows = (cos1, cos2, sin1, sin2, pos)
    return bias, next_nw, rope_rows


@triton.jit
def _rope_epilogue(acc, first_pair, offs_m, m_ok, T, rope_rows, QOut, KCache, VCache,
                   stride_qb, stride_qh, stride_qt, stride_cb, stride_ch, stride_cn,
                   HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_N: tl.constexpr,
                   BLOCK_M: tl.constexpr):
    """What kernels.rope_cache does after the q/k/v projection, on this tile's sums acc [BLOCK_N,
    rows] (dims d, then d + D/2, of one head): round to the model dtype, rotate q and k ("rotate
    half", with `_epilogue_inputs`' rope rows: cos/sin rounded to the model dtype as there), store
    q rows to QOut and k/v rows into the caches at their positions. The rotation is
    kernels.rope_cache's own (`rotate_with`): the same bits."""
    HALF_D: tl.constexpr = HEAD_DIM // 2
    dtype = KCache.dtype.element_ty
    cos1, cos2, sin1, sin2, pos = rope_rows
    x1, x2 = tl.split(tl.permute(tl.reshape(acc.to(dtype).to(tl.float32), [2, HALF_N, BLOCK_M]), [1, 2, 0]))
    head = first_pair // HALF_D
    d = (first_pair % HALF_D + tl.arange(0, HALF_N))[:, None]           # [HALF_N, 1]
    b = offs_m // T
    t = offs_m % T
    ok = m_ok[None, :]
    if head < HQ + HKV:
        y1, y2 = rotate_with(x1, x2, cos1, cos2, sin1, sin2)
    else:                                             # a value head: stored as it is
        y1 = x1
        y2 = x2
    if head < HQ:
        dst = QOut + (b * stride_qb + head * stride_qh + t * stride_qt)[None, :] + d
        tl.store(dst, y1.to(QOut.dtype.element_ty), mask=ok)
        tl.store(dst + HALF_D, y2.to(QOut.dtype.element_ty), mask=ok)
    else:
        if head < HQ + HKV:
            dst = KCache + (b * stride_cb + (head - HQ) * stride_ch + pos * stride_cn)[None, :] + d
        else:
            dst = VCache + (b * stride_cb + (head - HQ - HKV) * stride_ch + pos * stride_cn)[None, :] + d
        tl.store(dst, y1.to(dtype), mask=ok)
        tl.store(dst + HALF_D, y2.to(dtype), mask=ok)


@triton.jit
def _epilogue(acc, gate, up, cols, offs_m, mask, part, M, bias, Res, next_nw, Out, WeightedOut, SumSqOut,
              stride_rm, stride_om, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
              EMIT_NORM: tl.constexpr):
    """The finished float32 sums [cols, rows] (gate and up halves when GATED) -> the output rows:
    bias or silu(gate) * up, the cast, the residual, the store, and the next norm's inputs
    (bias, next_nw: `_epilogue_inputs`)."""
    dtype = Out.dtype.element_ty
    if GATED:
        y = silu_mul_rounded(gate, up, dtype)
    else:
        if HAS_BIAS:
            acc += bias[:, None]
        y = acc.to(dtype)
    if RESIDUAL:
        res = tl.load(Res + offs_m[None, :] * stride_rm + cols[:, None], mask=mask, other=0.0)
        y = (y.to(tl.float32) + res.to(tl.float32)).to(dtype)
    tl.store(Out + offs_m[None, :] * stride_om + cols[:, None], y, mask=mask)
    if EMIT_NORM:
        _emit_norm_inputs(y, cols, offs_m, mask, part, M, next_nw, WeightedOut, SumSqOut, stride_om)


@triton.jit
def silu_mul_rounded(gate, up, dtype: tl.constexpr):
    """silu(gate) * up in `dtype` from float32 sums, with the eager rounding: gate, up and silu(gate)
    each in the model dtype (kernels.fused_mlp computes its act with this same code)."""
    g = gate.to(dtype).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return (silu * up.to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _emit_norm_inputs(y, cols, offs_m, mask, part, M, next_nw, WeightedOut, SumSqOut, stride_om):
    """What the next projection's folded RMSNorm needs from the rows y [cols, rows] just written:
    norm_weight * y in the model dtype (its x; next_nw [cols] f32 is norm_weight), and this
    program's part of each row's sum of squares."""
    y32 = tl.where(mask, y.to(tl.float32), 0.0)
    tl.store(WeightedOut + offs_m[None, :] * stride_om + cols[:, None], (y32 * next_nw[:, None]).to(y.dtype),
             mask=mask)
    tl.store(SumSqOut + part * M + offs_m, tl.sum(y32 * y32, 0), mask=offs_m < M)


@triton.jit(do_not_specialize=["M", "trace_row"])
def _reduce_splits_kernel(
    Part, Bias, Res, Out, NextNormW, WeightedOut, SumSqOut,
    # Part [SPLITS, M, N] f32; Bias [N]; Res, Out, WeightedOut [M, N]; SumSqOut [cdiv(N, BLOCK), M] f32
    M, N, stride_rm, stride_om,
    SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr, EMIT_NORM: tl.constexpr,
    USE_PDL: tl.constexpr, TRIGGER: tl.constexpr, EARLY: tl.constexpr, BLOCK: tl.constexpr,
    Trace, trace_row, TRACE: tl.constexpr,       # kernels._trace
):
    """EARLY: bias, residual and next norm weight are read before griddepcontrol.wait (the residual
    settled: written two or more launches back, kernels._pdl); only the partials wait."""
    trace_mark(Trace, trace_row, START, TRACE)
    pdl_trigger(USE_PDL, TRIGGER, 0)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    if EARLY:
        bias, res, next_nw = reduce_epilogue_inputs(Bias, Res, NextNormW, row, offs, ok, stride_rm, HAS_BIAS,
                                                     RESIDUAL, EMIT_NORM)
    pdl_wait(USE_PDL, TRIGGER)
    trace_mark(Trace, trace_row, WAITED, TRACE)
    acc = tl.load(Part + row * N + offs, mask=ok, other=0.0)
    # fixed order: split 0, 1, 2, ...; unrolled, so every partial's load is in flight at once
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(Part + (s * M + row) * N + offs, mask=ok, other=0.0)
    pdl_trigger(USE_PDL, TRIGGER, 2)
    if not EARLY:
        bias, res, next_nw = reduce_epilogue_inputs(Bias, Res, NextNormW, row, offs, ok, stride_rm, HAS_BIAS,
                                                     RESIDUAL, EMIT_NORM)
    if HAS_BIAS:
        acc += bias
    y = acc.to(Out.dtype.element_ty)
    if RESIDUAL:
        y = (y.to(tl.float32) + res.to(tl.float32))
        y = y.to(Out.dtype.element_ty)
    store_reduced_row(y, Out, row, offs, ok, stride_om, M, next_nw, WeightedOut, SumSqOut, EMIT_NORM)
    trace_mark(Trace, trace_row, END, TRACE)


@triton.jit
def store_reduced_row(y, Out, row, offs, ok, stride_om, M, next_nw, WeightedOut, SumSqOut, EMIT_NORM: tl.constexpr):
    """A reduce program's finished columns y [BLOCK] of row `row` -> Out, and with EMIT_NORM the next
    norm's inputs (its part of the row's sum of squares is part tl.program_id(1))."""
    tl.store(Out + row * stride_om + offs, y, mask=ok)
    if EMIT_NORM:
        rows = row + tl.arange(0, 1)
        _emit_norm_inputs(y[:, None], offs, rows, ok[:, None], tl.program_id(1), M, next_nw, WeightedOut, SumSqOut,
                          stride_om)


@triton.jit
def reduce_epilogue_inputs(Bias, Res, NextNormW, row, offs, ok, stride_rm, HAS_BIAS: tl.constexpr,
                            RESIDUAL: tl.constexpr, EMIT_NORM: tl.constexpr):
    """(bias f32, residual, next norm weight f32) [BLOCK] of the reduce's row and columns; 0.0 for an
    input it does not use."""
    bias = 0.0
    res = 0.0
    next_nw = 0.0
    if HAS_BIAS:
        bias = tl.load(Bias + offs, mask=ok, other=0.0).to(tl.float32)
    if RESIDUAL:
        res = tl.load(Res + row * stride_rm + offs, mask=ok, other=0.0, cache_modifier=".cg")
    if EMIT_NORM:
        next_nw = tl.load(NextNormW + offs, mask=ok, other=0.0).to(tl.float32)
    return bias, res, next_nw


@triton.jit
def _norm_inputs_kernel(H, NormW, Weighted, SumSq, M, K, stride_h, USE_PDL: tl.constexpr, BLOCK: tl.constexpr):
    pdl_wait(USE_PDL, AFTER_WAIT)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < K
    norm_row(tl.load(H + row * stride_h + offs, mask=ok, other=0.0), NormW, Weighted, SumSq, row, K, offs, ok)


@triton.jit
def norm_row(h, NormW, Weighted, SumSq, row, K, offs, ok):
    """Row `row` of NormInputs from its values h [BLOCK] (masked by ok): norm_weight * h in the
    model dtype, and the row's sum of squares (kernels.step_inputs runs this same code)."""
    h = h.to(tl.float32)
    nw = tl.load(NormW + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(Weighted + row * K + offs, (h * nw).to(Weighted.dtype.element_ty), mask=ok)
    tl.store(SumSq + row, tl.sum(h * h, 0))


def norm_inputs_triton(h: torch.Tensor, norm_weight: torch.Tensor):
    """h [M, K] -> NormInputs(norm_weight * h, sums of squares [1, M]), one program per row."""
    from batchd.kernels.small_matmul.reference import NormInputs

    M, K = h.shape
    weighted = torch.empty_like(h)
    sumsq = torch.empty(1, M, dtype=torch.float32, device=h.device)
    pdl = pdl_enabled(h.device)
    block, num_warps = norm_row_launch(K)
    _norm_inputs_kernel[(M,)](h, norm_weight, weighted, sumsq, M, K, h.stride(0), USE_PDL=pdl, BLOCK=block,
                              num_warps=num_warps, **launch_options(pdl))
    return NormInputs(weighted, sumsq)


def norm_row_launch(K: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of a program running `norm_row` on rows of K: the block and the warps
    decide the order of the sum of squares, so every kernel that calls norm_row launches with
    these (kernels.step_inputs gives the same bits as norm_inputs_triton)."""
    block = triton.next_power_of_2(K)
    return block, 4 if block <= 2048 else 8


def dot_flags(dtype: torch.dtype) -> tuple[bool, str]:
    """(UPCAST_DOT, DOT_PRECISION): IEEE products for float32 (not TF32); under the CPU interpreter
    bf16 tiles go to float32 first (triton 3.6's interpreter multiplies bf16 tiles as raw integers)."""
    precision = "ieee" if dtype == torch.float32 else "tf32"
    return interpreting() and dtype == torch.bfloat16, precision


def _linear_label(N: int, K: int, gated: bool, rope: bool, splits: int, residual: bool) -> str:
    """How a kernel trace names a small_linear launch: its weight shape and fusions."""
    kind = " gated" if gated else " rope" if rope else " residual" if residual else ""
    return f"linear {N}x{K}{kind}" + (f" {splits} splits" if splits > 1 else "")


def linear_constexprs(config: SmallLinearConfig, N: int, K: int, dtype: torch.dtype, *, bias: bool, norm_parts: int,
                      gated: bool, residual: bool, emit: bool, pdl: bool, early: bool,
                      rope_heads: tuple[int, int, int] | None) -> dict:
    """The constexpr arguments of `_small_linear_kernel` for a call: N outputs (gated: of a [2N, K]
    weight), a bias, a folded norm whose sums of squares come in `norm_parts` parts (0: none), the
    residual and emitted norm inputs, rope into (Hq, Hkv, head_dim) heads. small_linear_triton
    launches with these, and bench/kernel_resources.py compiles the kernel with them on any machine."""
    upcast, precision = dot_flags(dtype)
    split = config.effective_splits(K) > 1
    out_n = config.block_n // 2 if gated else config.block_n
    heads, kv_heads, head_dim = rope_heads or (1, 1, 2)
    trigger = pdl_trigger_point("linear") if config.trigger is None else config.trigger
    return dict(
        HAS_BIAS=bias, SPLIT=split, SWAP=config.swap, EVEN_N=N % out_n == 0, EVEN_K=K % config.block_k == 0,
        UPCAST_DOT=upcast, DOT_PRECISION=precision, SCALE_ROWS=norm_parts > 0,
        PARTS_P2=triton.next_power_of_2(max(1, norm_parts)), GATED=gated, RESIDUAL=residual,
        EMIT_NORM=emit and not split, USE_PDL=pdl, TRIGGER=trigger,
        PRELOAD=config.preload_steps(K), EARLY=early, ROPE=rope_heads is not None, HQ=heads, HKV=kv_heads,
        HEAD_DIM=head_dim, GEMV=config.gemv, K_P2=triton.next_power_of_2(K) if config.gemv else 1,
        BLOCK_M=BLOCK_M, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        **({"SKIP_WAIT": True} if config.skip_wait else {}))


def small_linear_triton(
    x: torch.Tensor,                     # [M, K], M = 1..32, stride(1) == 1
    weight: torch.Tensor,                # [N, K] ([2N, K] when gated), stride(1) == 1
    bias: torch.Tensor | None,           # [N] contiguous or None
    *,
    row_sumsq: torch.Tensor | None = None,       # [P, M] f32: scale row m by rsqrt(sum_p / K + eps)
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,        # [M, N], stride(1) == 1: out = residual + product
    gated: bool = False,                         # out = silu(x Wg^T) * (x Wu^T)
    emit_norm_weight: torch.Tensor | None = None,  # [N]: also return NormInputs of out for that norm
    rope: RopeTarget | None = None,              # the q/k/v projection: rope + cache write, -> q
    settled: bool = False,                       # residual / rope rows written two or more launches back
    config: SmallLinearConfig | None = None,
):
    """Shapes are validated by the public wrapper; `config` overrides the table (tests, bench --tune).
    With `settled` (and `early_reads_enabled()`) the kernels read the rope rows, the constant epilogue
    inputs and (in a k split's reduce) the residual before griddepcontrol.wait (kernels._pdl,
    "Settled inputs").
    -> out [M, N], or (out, NormInputs) with emit_norm_weight, or rotated q [B, Hq, T, D] with rope
    (the caller checks `rope_fits` first)."""
    from batchd.kernels.small_matmul.reference import NormInputs

    M, K = x.shape
    N = weight.shape[0] // 2 if gated else weight.shape[0]
    if config is None:
        config = choose_config(N, K, x.dtype, x.device, gated=gated)
    if config.stream:
        from batchd.kernels.stream_linear import stream_linear

        return stream_linear(x, weight, bias, row_sumsq=row_sumsq, eps=eps, residual=residual, gated=gated,
                             emit_norm_weight=emit_norm_weight, ring_bytes=config.ring_kb * 1024,
                             ctas_per_sm=config.stream_ctas, min_shared_bytes=config.stream_min_kb * 1024,
                             max_ctas=config.stream_max_ctas,
                             rope=rope, settled=settled,
                             trigger_at_start=config.trigger == 0, backend="cuda")
    k_per_split = config.k_per_split(K)
    splits = triton.cdiv(K, k_per_split)
    if gated and (splits > 1 or config.block_n % 32 or config.gemv):
        raise ValueError(f"a gated projection needs no k split, no gemv and block_n % 32 == 0 (config {config})")
    out_n = config.block_n // 2 if gated else config.block_n
    if config.gemv and K > 2048:          # (a gemv never splits: SmallLinearConfig.k_per_split)
        raise ValueError(f"a gemv config holds whole weight rows of K <= 2048 in registers (K = {K}, config {config})")
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, out_n), splits)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    part = torch.empty(splits, M, N, dtype=torch.float32, device=x.device) if splits > 1 else out
    emit = emit_norm_weight is not None
    if emit:
        weighted = torch.empty_like(out)
        emit_parts = triton.cdiv(N, REDUCE_BLOCK) if splits > 1 else grid[1]
        sumsq_out = torch.empty(emit_parts, M, dtype=torch.float32, device=x.device)
    else:
        weighted, sumsq_out = out, part
    pdl = pdl_enabled(x.device)
    bias_arg = bias if bias is not None else out
    res_arg = residual if residual is not None else out
    parts_in = row_sumsq.shape[0] if row_sumsq is not None else 1
    early = settled and early_reads_enabled()
    if rope is not None:
        k_cache = rope.k_cache
        B, head_dim = k_cache.shape[0], k_cache.shape[3]
        T, heads, kv_heads = M // B, rope.num_heads, rope.num_kv_heads
        q_out = torch.empty(B, heads, T, head_dim, dtype=x.dtype, device=x.device)
        rope_args = (rope.cos, rope.sin, rope.positions, q_out, k_cache, rope.v_cache)
        rope_strides = (*q_out.stride()[:3], *k_cache.stride()[:3])
        rope_heads = (heads, kv_heads, head_dim)
    else:
        rope_args, rope_strides = (out,) * 6, (0,) * 6
        T, rope_heads = 1, None
    _small_linear_kernel[grid](
        x, weight, bias_arg, res_arg, out, part, row_sumsq if row_sumsq is not None else part,
        emit_norm_weight if emit else out, weighted, sumsq_out, *rope_args,
        M, N, K, eps, parts_in, T,
        x.stride(0), weight.stride(0), res_arg.stride(0), out.stride(0), *rope_strides,
        k_per_split,
        **linear_constexprs(config, N, K, x.dtype, bias=bias is not None,
                            norm_parts=parts_in if row_sumsq is not None else 0, gated=gated,
                            residual=residual is not None, emit=emit, pdl=pdl, early=early,
                            rope_heads=rope_heads),
        **trace_args(_linear_label(N, K, gated, rope is not None, splits, residual is not None), grid, out),
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(pdl),
    )
    if rope is not None:
        return q_out
    if splits > 1:
        reduce_grid = (M, triton.cdiv(N, REDUCE_BLOCK))
        _reduce_splits_kernel[reduce_grid](
            part, bias_arg, res_arg, out, emit_norm_weight if emit else out, weighted, sumsq_out,
            M, N, res_arg.stride(0), out.stride(0),
            SPLITS=splits, HAS_BIAS=bias is not None, RESIDUAL=residual is not None, EMIT_NORM=emit, USE_PDL=pdl,
            TRIGGER=pdl_trigger_point("reduce") if config.reduce_trigger is None else config.reduce_trigger,
            EARLY=early, BLOCK=REDUCE_BLOCK,
            **trace_args(f"reduce {N} of {splits} splits", reduce_grid, out), num_warps=4, **launch_options(pdl),
        )
    return (out, NormInputs(weighted, sumsq_out)) if emit else out


__all__ = [
    "RopeTarget",
    "rope_fits",
    "small_linear_triton",
    "norm_inputs_triton",
    "norm_row",
    "norm_row_launch",
    "SmallLinearConfig",
    "choose_config",
    "heuristic_config",
    "TUNED",
    "BLOCK_M",
]
