"""Triton kernels for sparse decode attention: block scoring, per-lane top-k selection, and attention
over the union of the lanes' blocks.

Scoring: program (block chunk c, batch b, KV head h) bounds q . k for the group's query rows against
BLOCK_B block summaries, using the exact split
    sum_d max(q_d*lo_d, q_d*hi_d) = max(q, 0) . hi + min(q, 0) . lo
as two tile products in the cache's dtype (products exact, float32 accumulation), then takes the max
over the group's heads and applies the per-lane visible/forced rules. The query tile always holds 16
lanes (rows past Q are masked), so a lane's scores do not depend on how many lanes the call has.

Selection: program (lane i, batch b, KV head h) finds the top_k-th largest score by bisection on the
scores' order-preserving integer keys (32 steps, no sort), keeps every block above it and the
lowest-numbered ties, and writes the lane's row of a [B, Hkv, Q, NB] block mask.

Attention: program (split s, batch b, KV head h) owns the cache rows of the dense kernel's split s
(same boundaries, fixed by the cache capacity). It ORs the lanes' mask rows over its blocks into one
lane bitmask per block, then walks the blocks some lane chose, in ascending order, each loaded once
for all lanes and query heads of the group; a lane that did not choose a block gets score -inf there.
Online softmax leaves a lane's (m, l, acc) bitwise unchanged over a block fully masked for it
(alpha = exp2(0) = 1, p = 0), so each lane accumulates exactly its own blocks in ascending order,
within the same splits, with the same tile shape (16 lanes) as when it runs alone as a decode step:
a verify lane equals its decode step bit for bit. With every visible block chosen the kernel performs
the dense kernel's arithmetic block for block, so it also equals dense attention bit for bit (with
block_size equal to the dense kernel's 64-row blocks).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchd.kernels._backend import interpreting, launch_options, patch_interpreter_index, pdl_enabled
from batchd.kernels._pdl import AFTER_WAIT, pdl_wait
from batchd.kernels.decode_attention.triton_kernel import (
    INVARIANT_Q_ROWS,
    attend_block,
    store_split,
    LOG2E,
    _split_len,
    default_num_splits,
    dot_flags,
    invariant_tile_rows,
    merge_splits,
)

if interpreting():
    patch_interpreter_index()


@triton.jit
def _block_scores_kernel(
    Q, KMin, KMax, SeqLen, Scores,   # Q [B, Hq, QR, D]; KMin/KMax [B, Hkv, NB, D]; Scores [B, Hkv, QR, NB] f32
    stride_qb, stride_qh, stride_qq,
    stride_sb, stride_sh, stride_sn,  # KMin and KMax share strides
    H_KV, N_BLOCKS,
    Q_ROWS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, RECENT: tl.constexpr,
    G_P2: tl.constexpr, LANES: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
    D_CHUNK: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    tl.static_assert(LANES >= Q_ROWS)
    pdl_wait(USE_PDL, AFTER_WAIT)                 # inputs come from the kernel before (programmatic launch)
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H_KV
    kvh = pid_bh % H_KV
    seq_len = tl.load(SeqLen + b).to(tl.int32)

    # row r of the query tile is (head kvh*G + r // LANES, lane r % LANES), so a reshape splits heads off
    offs_m = tl.arange(0, G_P2 * LANES)
    g = offs_m // LANES
    lane = offs_m % LANES
    row_ok = (g < GROUP) & (lane < Q_ROWS)
    offs_b = pid_c * BLOCK_B + tl.arange(0, BLOCK_B)
    b_ok = offs_b < N_BLOCKS
    q_base = Q + b * stride_qb + (kvh * GROUP + g)[:, None] * stride_qh + lane[:, None] * stride_qq
    s_base = b * stride_sb + kvh * stride_sh + offs_b[:, None] * stride_sn

    bound = tl.zeros([G_P2 * LANES, BLOCK_B], dtype=tl.float32)
    for d0 in range(0, BLOCK_D, D_CHUNK):
        offs_d = d0 + tl.arange(0, D_CHUNK)
        d_ok = offs_d < HEAD_DIM
        q = tl.load(q_base + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        s_mask = b_ok[:, None] & d_ok[None, :]
        lo = tl.load(KMin + s_base + offs_d[None, :], mask=s_mask, other=0.0)       # [BLOCK_B, D_CHUNK]
        hi = tl.load(KMax + s_base + offs_d[None, :], mask=s_mask, other=0.0)
        if UPCAST_DOT:
            q = q.to(tl.float32)
            lo = lo.to(tl.float32)
            hi = hi.to(tl.float32)
        zero = tl.zeros_like(q)
        q_pos = tl.where(q > zero, q, zero)
        q_neg = tl.where(q < zero, q, zero)
        bound = tl.dot(q_pos, tl.trans(hi), bound, input_precision=DOT_PRECISION)
        bound = tl.dot(q_neg, tl.trans(lo), bound, input_precision=DOT_PRECISION)
    bound = tl.where(row_ok[:, None], bound, float("-inf"))
    best = tl.max(tl.reshape(bound, (G_P2, LANES, BLOCK_B)), 0)                             # [LANES, BLOCK_B]

    lanes = tl.arange(0, LANES)
    last_block = (seq_len - Q_ROWS + lanes) // BLOCK_SIZE                                   # [LANES]
    visible = offs_b[None, :] <= last_block[:, None]
    forced = visible & ((offs_b[None, :] == 0) | (offs_b[None, :] > last_block[:, None] - RECENT))
    score = tl.where(forced, float("inf"), tl.where(visible, best, float("-inf")))
    out_ptrs = Scores + (pid_bh * Q_ROWS + lanes[:, None]) * N_BLOCKS + offs_b[None, :]
    tl.store(out_ptrs, score, mask=(lanes[:, None] < Q_ROWS) & b_ok[None, :])


@triton.jit
def _select_blocks_kernel(
    Scores, SeqLen, Selected,    # Scores [B, Hkv, QR, NB] f32; Selected [B, Hkv, QR, NB] uint8 (0/1)
    H_KV, N_BLOCKS,
    Q_ROWS: tl.constexpr, TOP_K: tl.constexpr, KEEP_ALL_ROWS: tl.constexpr, NB_P2: tl.constexpr,
    LANE_TILE: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL, AFTER_WAIT)                 # inputs come from the kernel before (programmatic launch)
    # Integer logic only, so a lane's row is the same whichever program (and LANE_TILE) handles it.
    pid_bh = tl.program_id(1)                     # flat (b, kvh)
    seq_len = tl.load(SeqLen + pid_bh // H_KV).to(tl.int32)
    lane = tl.program_id(0) * LANE_TILE + tl.arange(0, LANE_TILE)
    offs = tl.arange(0, NB_P2)
    ok = (lane < Q_ROWS)[:, None] & (offs < N_BLOCKS)[None, :]
    ptrs = (pid_bh * Q_ROWS + lane[:, None]) * N_BLOCKS + offs[None, :]
    score = tl.load(Scores + ptrs, mask=ok, other=float("-inf"))                # [LANE_TILE, NB_P2]
    bits = score.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)                           # int32, ordered like the floats

    # per lane, the largest t with at least TOP_K keys >= t: bisection over the 2**32 int32 values
    # (bounds in int64 so that lo + hi cannot overflow; every midpoint fits in int32)
    lo = tl.full([LANE_TILE], -2147483648, tl.int64)
    hi = tl.full([LANE_TILE], 2147483647, tl.int64)
    for _ in range(32):
        mid = (lo + hi + 1) >> 1
        enough = tl.sum((ok & (key >= mid.to(tl.int32)[:, None])).to(tl.int32), 1) >= TOP_K
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    threshold = lo.to(tl.int32)
    above = ok & (key > threshold[:, None])
    tied = ok & (key == threshold[:, None])
    room = TOP_K - tl.sum(above.to(tl.int32), 1)
    chosen = above | (tied & (tl.cumsum(tied.to(tl.int32), 1) <= room[:, None]))    # ties: lowest block ids
    visible = score > float("-inf")
    # a lane that sees at most KEEP_ALL_ROWS rows attends to all of them (dense attention, bitwise)
    keep_all = seq_len - Q_ROWS + lane + 1 <= KEEP_ALL_ROWS
    chosen = (chosen | keep_all[:, None]) & visible
    tl.store(Selected + ptrs, chosen.to(tl.uint8), mask=ok)


@triton.jit
def _sparse_split_kernel(
    Q, K, V, SeqLen, Selected,   # Selected [B, Hkv, QR, NB] uint8, contiguous
    O_part, L_part,              # O_part [B, Hq, QR, NUM_SPLITS, D] f32; L_part [B, Hq, QR, NUM_SPLITS] f32 (log2)
    qk_scale,
    stride_qb, stride_qh, stride_qq,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    H_KV, S_MAX, N_BLOCKS,
    Q_ROWS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT_BLOCKS: tl.constexpr, LANES: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    tl.static_assert(BLOCK_M >= GROUP * Q_ROWS)
    tl.static_assert(LANES >= Q_ROWS)
    pdl_wait(USE_PDL, AFTER_WAIT)                 # inputs come from the kernel before (programmatic launch)
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H_KV
    kvh = pid_bh % H_KV

    seq_len = tl.load(SeqLen + b).to(tl.int32)
    split_len = _split_len(S_MAX, NUM_SPLITS, BLOCK_N)     # the dense kernel's split boundaries
    start = pid_s * split_len
    if start >= seq_len:
        return

    # union of the lanes' chosen blocks in this split: one bitmask of lanes per block
    first = start // BLOCK_N
    offs_w = first + tl.arange(0, SPLIT_BLOCKS)
    w_ok = (offs_w < first + split_len // BLOCK_N) & (offs_w < N_BLOCKS)
    lanes = tl.arange(0, LANES)
    chosen = tl.load(Selected + (pid_bh * Q_ROWS + lanes[:, None]) * N_BLOCKS + offs_w[None, :],
                     mask=(lanes[:, None] < Q_ROWS) & w_ok[None, :], other=0)         # [LANES, SPLIT_BLOCKS]
    chosen_by = tl.sum(chosen.to(tl.int32) << lanes[:, None], 0)                      # [SPLIT_BLOCKS]
    in_union = chosen_by != 0
    rank = tl.cumsum(in_union.to(tl.int32), 0) - 1
    n_union = tl.sum(in_union.to(tl.int32), 0)

    # row r of the tile is (head kvh*G + r // QR, lane r % QR), as in the dense kernel
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    g = offs_m // Q_ROWS
    lane = offs_m % Q_ROWS
    row_ok = offs_m < GROUP * Q_ROWS
    d_ok = offs_d < HEAD_DIM
    limit = tl.where(row_ok, seq_len - Q_ROWS + lane, -1)       # last visible cache row per row
    head = kvh * GROUP + g

    q_ptrs = Q + b * stride_qb + head[:, None] * stride_qh + lane[:, None] * stride_qq + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)   # [BLOCK_M, BLOCK_D]
    if UPCAST_DOT:
        q = q.to(tl.float32)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for j in range(0, n_union):
        pick = in_union & (rank == j)
        block = tl.sum(tl.where(pick, offs_w, 0), 0)
        lane_bits = tl.sum(tl.where(pick, chosen_by, 0), 0)
        offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < seq_len                               # rows past seq_len may hold garbage (NaN)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        lane_chose = ((lane_bits >> lane) & 1) != 0                                 # [BLOCK_M]
        visible = (offs_n[None, :] <= limit[:, None]) & lane_chose[:, None]
        m_i, l_i, acc = attend_block(q, k, v, visible, m_i, l_i, acc, qk_scale, UPCAST_DOT, DOT_PRECISION)

    row = (b * H_KV * GROUP + head) * Q_ROWS + lane                       # flat (b, head, lane)
    store_split(acc, l_i, m_i, row, row_ok, pid_s, offs_d, d_ok, O_part, L_part, NUM_SPLITS, HEAD_DIM)


def block_scores_triton(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, seq_len: torch.Tensor,
                        block_size: int, recent_blocks: int, *, block_b: int = 64) -> torch.Tensor:
    """-> scores [B, Hkv, Q, NB] float32 (see reference.block_scores_reference)."""
    B, Hq, QR, D = q.shape
    Hkv, NB = kmin.shape[1], kmin.shape[2]
    G = Hq // Hkv
    g_p2 = triton.next_power_of_2(G)
    block_d = triton.next_power_of_2(D)
    upcast, precision = dot_flags(q.dtype)
    # 16-bit tiles go to the tensor cores whole; float32 ones in chunks of D that fit in registers
    d_chunk = block_d if q.dtype != torch.float32 and not upcast else min(32, block_d)
    scores = torch.empty(B, Hkv, QR, NB, dtype=torch.float32, device=q.device)
    pdl = pdl_enabled(q.device)
    _block_scores_kernel[(triton.cdiv(NB, block_b), B * Hkv)](
        q, kmin, kmax, seq_len, scores,
        q.stride(0), q.stride(1), q.stride(2),
        kmin.stride(0), kmin.stride(1), kmin.stride(2),
        Hkv, NB,
        Q_ROWS=QR, GROUP=G, HEAD_DIM=D, BLOCK_SIZE=block_size, RECENT=recent_blocks,
        G_P2=g_p2, LANES=INVARIANT_Q_ROWS, BLOCK_B=block_b, BLOCK_D=block_d, D_CHUNK=d_chunk,
        UPCAST_DOT=upcast, DOT_PRECISION=precision, USE_PDL=pdl,
        num_warps=4 if g_p2 * INVARIANT_Q_ROWS <= 64 else 8, **launch_options(pdl),
    )
    return scores


def select_from_scores_triton(scores: torch.Tensor, seq_len: torch.Tensor, top_k: int,
                              keep_all_rows: int) -> torch.Tensor:
    """-> chosen blocks [B, Hkv, Q, NB] bool (see reference.select_from_scores)."""
    B, Hkv, QR, NB = scores.shape
    selected = torch.empty(B, Hkv, QR, NB, dtype=torch.uint8, device=scores.device)
    nb_p2 = triton.next_power_of_2(NB)
    # a program per lane on the GPU (more programs in flight); all lanes in one under the interpreter,
    # whose cost is per operation. The result is the same either way.
    lane_tile = triton.next_power_of_2(QR) if interpreting() else 1
    pdl = pdl_enabled(scores.device)
    _select_blocks_kernel[(triton.cdiv(QR, lane_tile), B * Hkv)](
        scores.contiguous(), seq_len, selected,
        Hkv, NB,
        Q_ROWS=QR, TOP_K=top_k, KEEP_ALL_ROWS=keep_all_rows, NB_P2=nb_p2, LANE_TILE=lane_tile, USE_PDL=pdl,
        num_warps=4 if nb_p2 <= 2048 else 8, **launch_options(pdl),
    )
    return selected.view(torch.bool)


def sparse_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            seq_len: torch.Tensor, selected: torch.Tensor, block_size: int, scale: float,
                            *, num_splits: int | None = None, num_warps: int | None = None,
                            num_stages: int = 2, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """-> [B, Hq, Q, D] in q's dtype (or out_dtype): attention over the chosen blocks' visible rows, lane by lane.

    Tile, splits and warps are the dense kernel's defaults (G * 16 rows, default_num_splits with
    block_n = block_size), whatever Q is, so a sparse verify lane equals its sparse decode step (the
    dense kernel fits its tile for some G, DecodeTile; the two kernels never serve one step); the
    keyword knobs are for tuning (bench/attention.py) and must not depend on Q.
    out_dtype=torch.float32 keeps the merged result unrounded (bitwise tests see every difference).
    """
    B, Hq, QR, D = q.shape
    Hkv, S_max = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    NB = selected.shape[-1]
    block_m = invariant_tile_rows(G)
    if num_splits is None:
        num_splits = default_num_splits(B * Hkv, S_max, block_size, q.device)
    if num_warps is None:
        num_warps = 4 if block_m <= 64 else 8
    split_blocks = triton.cdiv(triton.cdiv(S_max, num_splits), block_size)
    o_part = torch.empty(B, Hq, QR, num_splits, D, dtype=torch.float32, device=q.device)
    l_part = torch.empty(B, Hq, QR, num_splits, dtype=torch.float32, device=q.device)
    upcast, precision = dot_flags(q.dtype)
    pdl = pdl_enabled(q.device)
    _sparse_split_kernel[(num_splits, B * Hkv)](
        q, k_cache, v_cache, seq_len, selected.contiguous().view(torch.uint8), o_part, l_part,
        scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        Hkv, S_max, NB,
        Q_ROWS=QR, GROUP=G, HEAD_DIM=D, NUM_SPLITS=num_splits,
        BLOCK_M=block_m, BLOCK_N=block_size, BLOCK_D=triton.next_power_of_2(D),
        SPLIT_BLOCKS=triton.next_power_of_2(split_blocks), LANES=INVARIANT_Q_ROWS,
        UPCAST_DOT=upcast, DOT_PRECISION=precision, USE_PDL=pdl,
        num_warps=num_warps, num_stages=num_stages, **launch_options(pdl),
    )
    # [B, Q, Hq, D] memory seen as [B, Hq, Q, D], as the dense kernel returns it (the o projection's rows)
    out = torch.empty(B, QR, Hq, D, dtype=out_dtype or q.dtype, device=q.device).transpose(1, 2)
    return merge_splits(o_part, l_part, out, seq_len, block_n=block_size, splits_from_seq_len=True, s_max=S_max)


@triton.jit
def _summarise_block(K, KMin, KMax, block, new_len, stride_kb, stride_kh, stride_kn, stride_sb, stride_sh, stride_sn,
                     H_KV, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr):
    # min and max over the rows of `block` below new_len, for this program's (batch, KV head)
    pid_bh = tl.program_id(1)
    b = pid_bh // H_KV
    kvh = pid_bh % H_KV
    offs_n = block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    mask = (offs_n < new_len)[:, None] & d_ok[None, :]
    rows = tl.load(K + b * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :],
                   mask=mask, other=0.0).to(tl.float32)                                    # [BLOCK_SIZE, BLOCK_D]
    lo = tl.min(tl.where(mask, rows, float("inf")), 0)
    hi = tl.max(tl.where(mask, rows, float("-inf")), 0)
    out = b * stride_sb + kvh * stride_sh + block * stride_sn + offs_d
    tl.store(KMin + out, lo.to(KMin.dtype.element_ty), mask=d_ok)
    tl.store(KMax + out, hi.to(KMax.dtype.element_ty), mask=d_ok)


@triton.jit
def _summary_update_kernel(
    K, KMin, KMax,              # K [B, Hkv, S_max, D]; KMin/KMax [B, Hkv, NB, D] in K's dtype
    first_block, new_len,
    stride_kb, stride_kh, stride_kn,
    stride_sb, stride_sh, stride_sn,
    H_KV,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL, AFTER_WAIT)  # the cache rows come from the kernel before
    block = first_block + tl.program_id(0)
    _summarise_block(K, KMin, KMax, block, new_len, stride_kb, stride_kh, stride_kn, stride_sb, stride_sh, stride_sn,
                     H_KV, HEAD_DIM, BLOCK_SIZE, BLOCK_D)


def summary_update_triton(k_cache: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, block_size: int,
                          old_len: int, new_len: int) -> None:
    """Recompute, in place, the summary blocks that rows [old_len, new_len) touch (new_len > old_len)."""
    B, Hkv, _, D = k_cache.shape
    first = old_len // block_size
    n_blocks = triton.cdiv(new_len, block_size) - first
    pdl = pdl_enabled(k_cache.device)
    _summary_update_kernel[(n_blocks, B * Hkv)](
        k_cache, kmin, kmax, first, new_len,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        kmin.stride(0), kmin.stride(1), kmin.stride(2),
        Hkv,
        HEAD_DIM=D, BLOCK_SIZE=block_size, BLOCK_D=triton.next_power_of_2(D), USE_PDL=pdl,
        num_warps=4, **launch_options(pdl),
    )


@triton.jit
def _summary_update_at_kernel(
    K, KMin, KMax, Start,       # K [B, Hkv, S_max, D]; KMin/KMax [B, Hkv, NB, D]; Start [1] int64 on the device
    rows,
    stride_kb, stride_kh, stride_kn,
    stride_sb, stride_sh, stride_sn,
    H_KV,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Same as _summary_update_kernel, with the first row read on the device (CUDA-graph replays).
    pdl_wait(USE_PDL, AFTER_WAIT)  # the cache rows come from the kernel before
    start = tl.load(Start).to(tl.int32)
    new_len = start + rows
    block = start // BLOCK_SIZE + tl.program_id(0)
    if block * BLOCK_SIZE >= new_len:
        return
    _summarise_block(K, KMin, KMax, block, new_len, stride_kb, stride_kh, stride_kn, stride_sb, stride_sh, stride_sn,
                     H_KV, HEAD_DIM, BLOCK_SIZE, BLOCK_D)


def summary_update_at_triton(k_cache: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, block_size: int,
                             start: torch.Tensor, rows: int) -> None:
    """Recompute the blocks that rows [start, start + rows) touch, start ([1] int64) on the device."""
    B, Hkv, _, D = k_cache.shape
    max_blocks = triton.cdiv(rows, block_size) + 1  # rows may straddle one block edge
    pdl = pdl_enabled(k_cache.device)
    _summary_update_at_kernel[(max_blocks, B * Hkv)](
        k_cache, kmin, kmax, start, rows,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        kmin.stride(0), kmin.stride(1), kmin.stride(2),
        Hkv,
        HEAD_DIM=D, BLOCK_SIZE=block_size, BLOCK_D=triton.next_power_of_2(D), USE_PDL=pdl,
        num_warps=4, **launch_options(pdl),
    )
