"""Flash-decoding in Triton: split the key axis over programs, then merge the splits by log-sum-exp.

Program (split s, batch b, KV head h) loads the G*Q query rows of the heads that share KV head h
(G = Hq // Hkv) as one [BLOCK_M, D] tile, so each K/V block is read once for the whole group and
fed to tl.dot in the cache's own dtype (bf16/f16; no conversion of the cache). Scores, softmax
statistics and the output accumulate in float32.

The grid is sized from static shapes only (S_max, B, Hkv); each program derives its key range from
seq_len read on the device, so a call never syncs the host and can be captured in a CUDA graph.
Splits past seq_len exit at once; the merge kernel ignores them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchd.kernels._backend import (early_reads_enabled, interpreting, launch_options, multiprocessor_count,
                              patch_interpreter_index, pdl_enabled, pdl_trigger_point)
from batchd.kernels._pdl import pdl_trigger, pdl_wait
from batchd.kernels._trace import END, START, WAITED, trace_args, trace_mark

LOG2E = 1.4426950408889634
INVARIANT_Q_ROWS = 16  # tiles are sized for the widest verify, whatever Q a call has

if interpreting():
    patch_interpreter_index()


@triton.jit
def _split_len(s_max, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    # rows per split, a multiple of BLOCK_N; the split kernel and the merge kernel must agree on it.
    # From the cache capacity, not seq_len: split boundaries sit at fixed cache rows, so a lane's
    # partial sums are the same whether it is a decode step or one lane of a verify step
    # (greedy output must not change with speculation on or off).
    return tl.cdiv(tl.cdiv(s_max, NUM_SPLITS), BLOCK_N) * BLOCK_N


@triton.jit
def attend_block(q, k, v, visible, m_i, l_i, acc, qk_scale, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key block of the online softmax (this kernel's and the sparse split's): q [BLOCK_M, D],
    k/v [BLOCK_N, D], visible [BLOCK_M, BLOCK_N] which keys each tile row sees -> the updated
    (m_i, l_i, acc)."""
    if UPCAST_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale        # [BLOCK_M, BLOCK_N]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _load_kv_block(k_base, v_base, offs_n, rows_ok, offs_d, d_ok, stride_kn, stride_vn, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """The K and V rows offs_n of one KV head ([BLOCK_N, BLOCK_D] each; rows not in rows_ok read
    as 0). L2 only (".cg"): an EARLY kernel reads them before griddepcontrol.wait. A mask by rows
    alone where the head fills the block, so the loads stay 16-byte vectors."""
    if HEAD_DIM == BLOCK_D:
        kv_mask = rows_ok[:, None]
    else:
        kv_mask = rows_ok[:, None] & d_ok[None, :]
    k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0, cache_modifier=".cg")
    v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0, cache_modifier=".cg")
    return k, v


@triton.jit(do_not_specialize=["trace_row"])
def _decode_split_kernel(
    Q, K, V, SeqLen,           # Q [B, Hq, QR, D]; K, V [B, Hkv, S_max, D]; SeqLen [B] int64
    O_part, L_part,            # O_part [B, Hq, QR, NUM_SPLITS, D] f32; L_part [B, Hq, QR, NUM_SPLITS] f32 (log2)
    qk_scale,                  # softmax scale * log2(e)
    stride_qb, stride_qh, stride_qq,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    H_KV, S_MAX,
    Q_ROWS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, TRIGGER: tl.constexpr,
    EARLY: tl.constexpr, Trace, trace_row, TRACE: tl.constexpr,     # kernels._trace
):
    """EARLY: seq_len and the split's first key block, as far as it holds rows before the call's
    Q_ROWS new ones (below seq_len - Q_ROWS: the caller promises they were written two or more
    launches back, kernels._pdl "Settled inputs"), are read before griddepcontrol.wait; only q and
    the new rows, which the kernel just before wrote, wait for it. The first block is peeled off
    the loop either way, so both give the same sums."""
    tl.static_assert(BLOCK_M >= GROUP * Q_ROWS)
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    trace_mark(Trace, trace_row, START, TRACE)
    pdl_trigger(USE_PDL, TRIGGER, 0)
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H_KV
    kvh = pid_bh % H_KV
    split_len = _split_len(S_MAX, NUM_SPLITS, BLOCK_N)
    start = pid_s * split_len
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    offs_n = start + tl.arange(0, BLOCK_N)            # the first key block
    if EARLY:
        seq_len = tl.load(SeqLen + b, cache_modifier=".cg").to(tl.int32)
        end = tl.minimum(start + split_len, seq_len)
        cached = offs_n < tl.minimum(end, seq_len - Q_ROWS)     # rows before the call's new ones
        k_old, v_old = _load_kv_block(k_base, v_base, offs_n, cached, offs_d, d_ok, stride_kn, stride_vn,
                              HEAD_DIM, BLOCK_D)
    pdl_wait(USE_PDL, TRIGGER)                   # q and the new cache rows come from the kernel before
    trace_mark(Trace, trace_row, WAITED, TRACE)
    if not EARLY:
        seq_len = tl.load(SeqLen + b).to(tl.int32)
        end = tl.minimum(start + split_len, seq_len)
    if start >= seq_len:
        pdl_trigger(USE_PDL, TRIGGER, 2)
        trace_mark(Trace, trace_row, END, TRACE)
        return

    # row r of the tile is (head kvh*G + r // QR, lane r % QR)
    offs_m = tl.arange(0, BLOCK_M)
    g = offs_m // Q_ROWS
    lane = offs_m % Q_ROWS
    row_ok = offs_m < GROUP * Q_ROWS
    limit = tl.where(row_ok, seq_len - Q_ROWS + lane, -1)       # last visible cache row per row
    head = kvh * GROUP + g

    q_ptrs = Q + b * stride_qb + head[:, None] * stride_qh + lane[:, None] * stride_qq + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)   # [BLOCK_M, BLOCK_D]
    if UPCAST_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)   # finite: fully masked rows stay NaN-free
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # rows past seq_len may hold garbage (NaN): every load is masked to rows < end
    if EARLY:
        fresh = (offs_n < end) & (offs_n >= seq_len - Q_ROWS)   # this step's rows, from the kernel before
        k_new, v_new = _load_kv_block(k_base, v_base, offs_n, fresh, offs_d, d_ok, stride_kn, stride_vn,
                              HEAD_DIM, BLOCK_D)
        k = tl.where(fresh[:, None], k_new, k_old)
        v = tl.where(fresh[:, None], v_new, v_old)
    else:
        k, v = _load_kv_block(k_base, v_base, offs_n, offs_n < end, offs_d, d_ok, stride_kn, stride_vn,
                              HEAD_DIM, BLOCK_D)
    m_i, l_i, acc = attend_block(q, k, v, offs_n[None, :] <= limit[:, None], m_i, l_i, acc, qk_scale, UPCAST_DOT,
                                 DOT_PRECISION)
    for start_n in range(start + BLOCK_N, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v = _load_kv_block(k_base, v_base, offs_n, offs_n < end, offs_d, d_ok, stride_kn, stride_vn,
                              HEAD_DIM, BLOCK_D)
        m_i, l_i, acc = attend_block(q, k, v, offs_n[None, :] <= limit[:, None], m_i, l_i, acc, qk_scale, UPCAST_DOT,
                                     DOT_PRECISION)

    pdl_trigger(USE_PDL, TRIGGER, 2)
    row = (b * H_KV * GROUP + head) * Q_ROWS + lane                       # flat (b, head, lane)
    store_split(acc, l_i, m_i, row, row_ok, pid_s, offs_d, d_ok, O_part, L_part, NUM_SPLITS, HEAD_DIM)
    trace_mark(Trace, trace_row, END, TRACE)


@triton.jit
def store_split(acc, l_i, m_i, row, row_ok, pid_s, offs_d, d_ok, O_part, L_part, NUM_SPLITS: tl.constexpr,
                HEAD_DIM: tl.constexpr):
    """A split's normalised output and log2-sum-exp for the merge (this kernel's and the sparse
    split's), at flat rows `row` (b, head, lane); a row that saw no key stores lse = -inf."""
    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(L_part + row * NUM_SPLITS + pid_s, lse, mask=row_ok)
    o_ptrs = O_part + (row[:, None] * NUM_SPLITS + pid_s) * HEAD_DIM + offs_d[None, :]
    tl.store(o_ptrs, o, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["trace_row"])
def _merge_splits_kernel(
    O_part, L_part, Out, SeqLen,   # O_part [B, Hq, QR, NUM_SPLITS, D]; L_part [B, Hq, QR, NUM_SPLITS]; Out [B, Hq, QR, D]
    stride_ob, stride_oh, stride_oq,
    H_Q, S_MAX,
    Q_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_FROM_SEQ_LEN: tl.constexpr, USE_PDL: tl.constexpr,
    TRIGGER: tl.constexpr, EARLY: tl.constexpr, Trace, trace_row, TRACE: tl.constexpr,     # kernels._trace
):
    """EARLY: seq_len (settled, kernels._pdl) is read before griddepcontrol.wait."""
    trace_mark(Trace, trace_row, START, TRACE)
    pdl_trigger(USE_PDL, TRIGGER, 0)
    pid = tl.program_id(0)                   # flat (b, head, lane)
    b = pid // (H_Q * Q_ROWS)
    head = (pid // Q_ROWS) % H_Q
    lane = pid % Q_ROWS
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)   # this program's columns
    if EARLY and SPLITS_FROM_SEQ_LEN:
        n_active = _active_splits(SeqLen, b, S_MAX, NUM_SPLITS, BLOCK_N)
    pdl_wait(USE_PDL, TRIGGER)
    trace_mark(Trace, trace_row, WAITED, TRACE)
    if not SPLITS_FROM_SEQ_LEN:
        n_active = NUM_SPLITS
    elif not EARLY:                          # dense: splits past seq_len exited without writing
        n_active = _active_splits(SeqLen, b, S_MAX, NUM_SPLITS, BLOCK_N)
    s_ok = offs_s < n_active
    d_ok = offs_d < HEAD_DIM

    # o's loads are issued before lse's max: the max crosses warps (a barrier), and loads issued
    # after it would start a second L2 round trip after the wait (919 against 916 tok/s, NOTES stop 28)
    o = tl.load(O_part + (pid * NUM_SPLITS + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)         # [SPLITS_P2, BLOCK_D]
    lse = tl.load(L_part + pid * NUM_SPLITS + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m)                                          # [SPLITS_P2], 0 for empty splits
    pdl_trigger(USE_PDL, TRIGGER, 2)
    den = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(den > 0.0, den, 1.0)
    out_ptrs = Out + b * stride_ob + head * stride_oh + lane * stride_oq + offs_d
    tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=d_ok)
    trace_mark(Trace, trace_row, END, TRACE)


@triton.jit
def _active_splits(SeqLen, b, S_MAX, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Splits that hold rows below seq_len (the others exited without writing)."""
    seq_len = tl.load(SeqLen + b, cache_modifier=".cg").to(tl.int32)
    return tl.cdiv(seq_len, _split_len(S_MAX, NUM_SPLITS, BLOCK_N))


def dot_flags(dtype: torch.dtype) -> tuple[bool, str]:
    """(UPCAST_DOT, DOT_PRECISION) for tiles of `dtype`.

    float32 asks for IEEE products (the default would be TF32). The CPU interpreter multiplies bf16
    tiles as raw integers (triton 3.6), so there the kernels convert bf16 tiles to float32 first.
    """
    precision = "ieee" if dtype == torch.float32 else "tf32"
    return interpreting() and dtype == torch.bfloat16, precision


# At most this many key splits a call. At 32K rows of Qwen2.5-1.5B (2 KV heads) 132 splits put two
# programs on each of the H200's 132 SMs: 746 tok/s in whole decode steps against 734 with 128 (with
# 32-column merge programs; 714 with whole-head ones, whose tile of partials, its split axis padded
# to 256, no longer fits in registers). 64, 96, 192, 256 and 264 were all slower (docs/performance.md "Stop 17",
# "Stop 32").
MAX_SPLITS = 132


def default_num_splits(batch_heads: int, max_len: int, block_n: int, device: torch.device) -> int:
    """Enough splits for about four programs per multiprocessor, never more than there are key
    blocks or MAX_SPLITS."""
    sms = multiprocessor_count(device)
    return max(1, min(MAX_SPLITS, triton.cdiv(max_len, block_n), triton.cdiv(4 * sms, batch_heads)))


# Output columns a merge program takes (0: the whole head). 32: four programs a head at D = 128, each
# with a quarter of the partials to load; at 32K rows of Qwen2.5-1.5B whole steps ran 740 against
# 734 tok/s (64 columns: 740), and the split axis may pad to 256 without spilling (docs/performance.md "Stop 32").
MERGE_COLUMNS = 32


def merge_splits(o_part: torch.Tensor, l_part: torch.Tensor, out: torch.Tensor, seq_len: torch.Tensor,
                 *, block_n: int, splits_from_seq_len: bool, s_max: int = 0, early: bool = False) -> torch.Tensor:
    """Merge the splits' partial outputs into `out`; early: seq_len is settled (read before the wait).
    A program per (b, head, lane) and MERGE_COLUMNS output columns; every program computes its row's
    weights the same way, so the split of the columns changes no bits within a call's layout."""
    B, Hq, QR, num_splits, D = o_part.shape
    pdl = pdl_enabled(out.device)
    block_d = min(MERGE_COLUMNS or triton.next_power_of_2(D), triton.next_power_of_2(D))
    grid = (B * Hq * QR, triton.cdiv(D, block_d))
    _merge_splits_kernel[grid](
        o_part, l_part, out, seq_len,
        out.stride(0), out.stride(1), out.stride(2),
        Hq, s_max,
        Q_ROWS=QR, HEAD_DIM=D, NUM_SPLITS=num_splits, SPLITS_P2=triton.next_power_of_2(num_splits),
        BLOCK_N=block_n, BLOCK_D=block_d, SPLITS_FROM_SEQ_LEN=splits_from_seq_len,
        USE_PDL=pdl, TRIGGER=pdl_trigger_point("merge"), EARLY=early,
        **trace_args(f"attention merge of {num_splits}", grid, out), num_warps=4, **launch_options(pdl),
    )
    return out


@dataclass(frozen=True)
class DecodeTile:
    """How decode_attention_triton tiles a call for one query-head group size G. Every field is
    fixed per G, never by Q or seq_len: a lane's bits must not depend on the step's width.

    fit_rows=False: the tile always holds G * 16 rows (the widest verify), whatever Q is.
    fit_rows=True: it holds G * Q rows, at least 64 (a decode step's 6 rows of a G = 6 model in a
    64-row tile rather than 128). With num_warps fixed, a row goes through the same wgmma sequence
    in a 64- or 128-row tile (one warpgroup, 64 rows per instruction), so a lane's bits still match
    its verify lane; tests/engine/test_gpu_engine.py checks that bitwise on the H200."""
    block_n: int = 64
    num_warps: int | None = None    # None: 4 up to 64 rows, else 8
    num_stages: int = 2
    fit_rows: bool = False


# By group size G = Hq / Hkv, measured on the H200 (`python bench/attention.py --sweep-layout 12,2`
# and `14,2`, docs/performance.md): at 32K rows a decode step went from 19.7 to 11.2 us
# (40% -> 70% of copy) at G = 6 (Qwen2.5-1.5B) and from 18.0 to 11.1 us at G = 7 (Qwen2.5-0.5B, 7B).
# Other G keep the defaults (tuned at Llama-3-8B's G = 4 by the --sweep at 64K; G <= 4 already fits
# a 64-row tile).
TUNED_TILES: dict[int, DecodeTile] = {
    6: DecodeTile(block_n=32, num_warps=4, num_stages=3, fit_rows=True),
    7: DecodeTile(block_n=32, num_warps=4, num_stages=3, fit_rows=True),
}


def decode_tile(group: int) -> DecodeTile:
    return TUNED_TILES.get(group, DecodeTile())


def invariant_tile_rows(group: int) -> int:
    """Rows of the tile sized for the widest verify (G * 16, a power of two), whatever Q a call has:
    the dense kernel's default and the sparse kernel's only tile."""
    return max(16, triton.next_power_of_2(group * INVARIANT_Q_ROWS))


def decode_attention_triton(
    q: torch.Tensor,          # [B, Hq, Q, D], last dim contiguous
    k_cache: torch.Tensor,    # [B, Hkv, S_max, D], last dim contiguous
    v_cache: torch.Tensor,    # [B, Hkv, S_max, D], last dim contiguous
    seq_len: torch.Tensor,    # [B] int64 on q's device
    scale: float,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    block_m: int | None = None,
    settled: bool = False,
) -> torch.Tensor:
    """Shapes are validated by the public wrapper; the keyword knobs override `decode_tile(G)` for
    tuning (bench/attention.py). settled: see decode_attention."""
    B, Hq, QR, D = q.shape
    Hkv, S_max = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    tile = decode_tile(G)
    block_n = block_n or tile.block_n
    num_stages = num_stages or tile.num_stages
    # The tile's rows (rows past G*QR are masked): G * 16 for every Q, or G * Q of at least 64 rows
    # with fit_rows; either way a lane goes through the same MMA sequence in decode and in verify,
    # so its result is bitwise the same in both (DecodeTile).
    if block_m is None:
        block_m = max(64, triton.next_power_of_2(G * QR)) if tile.fit_rows else invariant_tile_rows(G)
    if num_splits is None:
        num_splits = default_num_splits(B * Hkv, S_max, block_n, q.device)
    if num_warps is None:
        num_warps = tile.num_warps or (4 if block_m <= 64 else 8)
    early = settled and early_reads_enabled()
    o_part = torch.empty(B, Hq, QR, num_splits, D, dtype=torch.float32, device=q.device)
    l_part = torch.empty(B, Hq, QR, num_splits, dtype=torch.float32, device=q.device)
    upcast, precision = dot_flags(q.dtype)
    pdl = pdl_enabled(q.device)
    grid = (num_splits, B * Hkv)
    _decode_split_kernel[grid](
        q, k_cache, v_cache, seq_len, o_part, l_part,
        scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        Hkv, S_max,
        Q_ROWS=QR, GROUP=G, HEAD_DIM=D, NUM_SPLITS=num_splits,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(D),
        UPCAST_DOT=upcast, DOT_PRECISION=precision, USE_PDL=pdl,
        TRIGGER=pdl_trigger_point("split"), EARLY=early, **trace_args(f"attention split x{num_splits}", grid, o_part),
        num_warps=num_warps, num_stages=num_stages, **launch_options(pdl),
    )
    # [B, Q, Hq, D] memory seen as [B, Hq, Q, D]: the o projection reads rows [B*Q, Hq*D] as they are
    out = torch.empty(B, QR, Hq, D, dtype=q.dtype, device=q.device).transpose(1, 2)
    return merge_splits(o_part, l_part, out, seq_len, block_n=block_n, splits_from_seq_len=True, s_max=S_max,
                        early=early)


__all__ = ["decode_attention_triton", "attend_block", "store_split", "DecodeTile", "TUNED_TILES", "decode_tile", "invariant_tile_rows", "merge_splits", "dot_flags", "default_num_splits", "LOG2E"]
