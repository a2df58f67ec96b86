"""Triton kernels for sparse decode attention: block scoring and attention over the selected blocks.

Scoring: program (block chunk c, batch b, KV head h) bounds q . k for the G*Q query rows of the group
against BLOCK_B block summaries with two tile products, using
    max(q*lo, q*hi) = q*(lo+hi)/2 + |q|*(hi-lo)/2        (elementwise, hi >= lo),
then takes the max over the group's heads and applies the per-lane visible/forced rules.

Attention: program (split s, batch b, KV head h, lane i) walks its share of the lane's top_k block ids,
each block one [BLOCK_SIZE, D] tile of K and V read in the cache's dtype, and writes float32 partials
that the dense path's merge kernel combines.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._backend import interpreting, multiprocessor_count, patch_interpreter_index
from kernels.decode_attention.triton_kernel import LOG2E, dot_flags, merge_splits

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
    G_P2: tl.constexpr, Q_P2: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
    D_CHUNK: tl.constexpr,
):
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H_KV
    kvh = pid_bh % H_KV
    seq_len = tl.load(SeqLen + b).to(tl.int32)

    # row r of the query tile is (head kvh*G + r // Q_P2, lane r % Q_P2), so a reshape splits heads off
    offs_m = tl.arange(0, G_P2 * Q_P2)
    g = offs_m // Q_P2
    lane = offs_m % Q_P2
    row_ok = (g < GROUP) & (lane < Q_ROWS)
    offs_b = pid_c * BLOCK_B + tl.arange(0, BLOCK_B)
    b_ok = offs_b < N_BLOCKS
    q_base = Q + b * stride_qb + (kvh * GROUP + g)[:, None] * stride_qh + lane[:, None] * stride_qq
    s_base = b * stride_sb + kvh * stride_sh + offs_b[:, None] * stride_sn

    bound = tl.zeros([G_P2 * Q_P2, BLOCK_B], dtype=tl.float32)
    for d0 in range(0, BLOCK_D, D_CHUNK):             # chunks of D keep the float32 tiles in registers
        offs_d = d0 + tl.arange(0, D_CHUNK)
        d_ok = offs_d < HEAD_DIM
        q = tl.load(q_base + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        s_mask = b_ok[:, None] & d_ok[None, :]
        lo = tl.load(KMin + s_base + offs_d[None, :], mask=s_mask, other=0.0).to(tl.float32)   # [BLOCK_B, D_CHUNK]
        hi = tl.load(KMax + s_base + offs_d[None, :], mask=s_mask, other=0.0).to(tl.float32)
        bound += tl.dot(q, tl.trans((lo + hi) * 0.5), input_precision="ieee")                 # q . center
        bound += tl.dot(tl.abs(q), tl.trans((hi - lo) * 0.5), input_precision="ieee")        # |q| . radius
    bound = tl.where(row_ok[:, None], bound, float("-inf"))
    best = tl.max(tl.reshape(bound, (G_P2, Q_P2, BLOCK_B)), 0)                               # [Q_P2, BLOCK_B]

    lanes = tl.arange(0, Q_P2)
    last_block = (seq_len - Q_ROWS + lanes) // BLOCK_SIZE                                   # [Q_P2]
    visible = offs_b[None, :] <= last_block[:, None]
    forced = visible & ((offs_b[None, :] == 0) | (offs_b[None, :] > last_block[:, None] - RECENT))
    score = tl.where(forced, float("inf"), tl.where(visible, best, float("-inf")))
    out_ptrs = Scores + ((b * H_KV + kvh) * Q_ROWS + lanes[:, None]) * N_BLOCKS + offs_b[None, :]
    tl.store(out_ptrs, score, mask=(lanes[:, None] < Q_ROWS) & b_ok[None, :])


@triton.jit
def _sparse_split_kernel(
    Q, K, V, SeqLen, BlockIds,   # BlockIds [B, Hkv, QR, TOP_K] int64, contiguous
    O_part, L_part,              # O_part [B, Hq, QR, NUM_SPLITS, D] f32; L_part [B, Hq, QR, NUM_SPLITS] f32 (log2)
    qk_scale,
    stride_qb, stride_qh, stride_qq,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    H_KV,
    Q_ROWS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, TOP_K: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    tl.static_assert(BLOCK_M >= GROUP)
    PER_SPLIT: tl.constexpr = (TOP_K + NUM_SPLITS - 1) // NUM_SPLITS
    pid_s = tl.program_id(0)
    pid = tl.program_id(1)                        # flat (b, kvh, lane)
    lane = pid % Q_ROWS
    kvh = (pid // Q_ROWS) % H_KV
    b = pid // (Q_ROWS * H_KV)
    seq_len = tl.load(SeqLen + b).to(tl.int32)
    limit = seq_len - Q_ROWS + lane               # last cache row this lane sees

    offs_m = tl.arange(0, BLOCK_M)                # row r = head kvh*G + r
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < GROUP
    d_ok = offs_d < HEAD_DIM
    head = kvh * GROUP + offs_m
    q_ptrs = Q + b * stride_qb + head[:, None] * stride_qh + lane * stride_qq + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    j0 = pid_s * PER_SPLIT
    j1 = tl.minimum(j0 + PER_SPLIT, TOP_K)
    for j in range(j0, j1):
        block = tl.load(BlockIds + pid * TOP_K + j).to(tl.int32)
        offs_n = block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        n_ok = offs_n <= limit                    # also keeps rows past seq_len (garbage) out
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    row = (b * H_KV * GROUP + head) * Q_ROWS + lane
    tl.store(L_part + row * NUM_SPLITS + pid_s, lse, mask=row_ok)
    tl.store(O_part + (row[:, None] * NUM_SPLITS + pid_s) * HEAD_DIM + offs_d[None, :], o,
             mask=row_ok[:, None] & d_ok[None, :])


def block_scores_triton(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, seq_len: torch.Tensor,
                        block_size: int, recent_blocks: int, *, block_b: int = 64) -> torch.Tensor:
    """-> scores [B, Hkv, Q, NB] float32 (see reference.block_scores_reference)."""
    B, Hq, QR, D = q.shape
    Hkv, NB = kmin.shape[1], kmin.shape[2]
    G = Hq // Hkv
    g_p2, q_p2 = triton.next_power_of_2(G), triton.next_power_of_2(QR)
    q_p2 = max(q_p2, triton.cdiv(16, g_p2))       # tile rows >= 16 for tl.dot
    scores = torch.empty(B, Hkv, QR, NB, dtype=torch.float32, device=q.device)
    _block_scores_kernel[(triton.cdiv(NB, block_b), B * Hkv)](
        q, kmin, kmax, seq_len, scores,
        q.stride(0), q.stride(1), q.stride(2),
        kmin.stride(0), kmin.stride(1), kmin.stride(2),
        Hkv, NB,
        Q_ROWS=QR, GROUP=G, HEAD_DIM=D, BLOCK_SIZE=block_size, RECENT=recent_blocks,
        G_P2=g_p2, Q_P2=q_p2, BLOCK_B=block_b, BLOCK_D=triton.next_power_of_2(D),
        D_CHUNK=min(32, triton.next_power_of_2(D)),
        num_warps=4 if g_p2 * q_p2 <= 64 else 8,
    )
    return scores


def sparse_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            seq_len: torch.Tensor, block_ids: torch.Tensor, block_size: int, scale: float,
                            *, num_splits: int | None = None, num_warps: int = 4,
                            num_stages: int = 2) -> torch.Tensor:
    """-> [B, Hq, Q, D] in q's dtype: attention over the selected blocks' visible rows."""
    B, Hq, QR, D = q.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    top_k = block_ids.shape[-1]
    block_ids = block_ids.contiguous()
    if num_splits is None:
        sms = multiprocessor_count(q.device)
        num_splits = max(1, min(top_k, triton.cdiv(2 * sms, B * Hkv * QR)))
    o_part = torch.empty(B, Hq, QR, num_splits, D, dtype=torch.float32, device=q.device)
    l_part = torch.empty(B, Hq, QR, num_splits, dtype=torch.float32, device=q.device)
    upcast, precision = dot_flags(q.dtype)
    _sparse_split_kernel[(num_splits, B * Hkv * QR)](
        q, k_cache, v_cache, seq_len, block_ids, o_part, l_part,
        scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        Hkv,
        Q_ROWS=QR, GROUP=G, HEAD_DIM=D, TOP_K=top_k, NUM_SPLITS=num_splits,
        BLOCK_M=max(16, triton.next_power_of_2(G)), BLOCK_SIZE=block_size, BLOCK_D=triton.next_power_of_2(D),
        UPCAST_DOT=upcast, DOT_PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages,
    )
    out = torch.empty(B, Hq, QR, D, dtype=q.dtype, device=q.device)
    return merge_splits(o_part, l_part, out, seq_len, block_n=block_size, splits_from_seq_len=False)


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
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
):
    block = first_block + tl.program_id(0)
    _summarise_block(K, KMin, KMax, block, new_len, stride_kb, stride_kh, stride_kn, stride_sb, stride_sh, stride_sn,
                     H_KV, HEAD_DIM, BLOCK_SIZE, BLOCK_D)


def summary_update_triton(k_cache: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, block_size: int,
                          old_len: int, new_len: int) -> None:
    """Recompute, in place, the summary blocks that rows [old_len, new_len) touch (new_len > old_len)."""
    B, Hkv, _, D = k_cache.shape
    first = old_len // block_size
    n_blocks = triton.cdiv(new_len, block_size) - first
    _summary_update_kernel[(n_blocks, B * Hkv)](
        k_cache, kmin, kmax, first, new_len,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        kmin.stride(0), kmin.stride(1), kmin.stride(2),
        Hkv,
        HEAD_DIM=D, BLOCK_SIZE=block_size, BLOCK_D=triton.next_power_of_2(D),
        num_warps=4,
    )


@triton.jit
def _summary_update_at_kernel(
    K, KMin, KMax, Start,       # K [B, Hkv, S_max, D]; KMin/KMax [B, Hkv, NB, D]; Start [1] int64 on the device
    rows,
    stride_kb, stride_kh, stride_kn,
    stride_sb, stride_sh, stride_sn,
    H_KV,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Same as _summary_update_kernel, with the first row read on the device (CUDA-graph replays).
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
    _summary_update_at_kernel[(max_blocks, B * Hkv)](
        k_cache, kmin, kmax, start, rows,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        kmin.stride(0), kmin.stride(1), kmin.stride(2),
        Hkv,
        HEAD_DIM=D, BLOCK_SIZE=block_size, BLOCK_D=triton.next_power_of_2(D),
        num_warps=4,
    )
