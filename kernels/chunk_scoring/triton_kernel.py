"""PFlash scoring pass in Triton, in two passes over K so no [Hq, T, S] matrix is ever stored.

Pass 1, program (split s, KV head h): the G*T tail rows of the heads sharing KV head h against the
split's keys -> per-row log-sum-exp of the split (log2 units). The splits merge in a tiny
logsumexp on [Hq, T, splits].
Pass 2, program (key block n): for every KV head, probabilities p = exp2(s - lse) of the group's rows
on the block, mean over the T rows of each head, max over heads; the running max over KV heads is
the block's score. Only [S] floats are written.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from batchd.kernels._backend import interpreting, multiprocessor_count, patch_interpreter_index
from batchd.kernels.decode_attention.triton_kernel import LOG2E, dot_flags

if interpreting():
    patch_interpreter_index()


@triton.jit
def _tail_lse_kernel(
    Q, K, L_part,               # Q [Hq, T, D]; K [Hkv, S, D]; L_part [Hq, T, NUM_SPLITS] f32 (log2)
    qk_scale, seq_len, split_len,
    stride_qh, stride_qt, stride_kh, stride_kn,
    T: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    G_P2: tl.constexpr, T_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_s = tl.program_id(0)
    kvh = tl.program_id(1)
    offs_m = tl.arange(0, G_P2 * T_P2)           # row r = (head kvh*G + r // T_P2, tail row r % T_P2)
    offs_d = tl.arange(0, BLOCK_D)
    g = offs_m // T_P2
    t = offs_m % T_P2
    row_ok = (g < GROUP) & (t < T)
    d_ok = offs_d < HEAD_DIM
    head = kvh * GROUP + g
    q = tl.load(Q + head[:, None] * stride_qh + t[:, None] * stride_qt + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    limit = tl.where(row_ok, seq_len - T + t, -1)

    start = pid_s * split_len
    end = tl.minimum(start + split_len, seq_len)
    m_i = tl.full([G_P2 * T_P2], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([G_P2 * T_P2], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(K + kvh * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :],
                    mask=(offs_n < end)[:, None] & d_ok[None, :], other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(offs_n[None, :] <= limit[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.math.exp2(m_i - m_new) + tl.sum(tl.math.exp2(s - m_new[:, None]), 1)
        m_i = m_new
    lse = tl.where(l_i > 0.0, m_i + tl.math.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
    tl.store(L_part + (head * T + t) * NUM_SPLITS + pid_s, lse, mask=row_ok)


@triton.jit
def _tail_probs_kernel(
    Q, K, Lse, Scores,          # Lse [Hq, T] f32 (log2); Scores [S] f32
    qk_scale, seq_len,
    stride_qh, stride_qt, stride_kh, stride_kn,
    H_KV,
    T: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    G_P2: tl.constexpr, T_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, G_P2 * T_P2)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    g = offs_m // T_P2
    t = offs_m % T_P2
    row_ok = (g < GROUP) & (t < T)
    d_ok = offs_d < HEAD_DIM
    n_ok = offs_n < seq_len
    visible = (offs_n[None, :] <= (seq_len - T + t)[:, None]) & row_ok[:, None]        # [M, BLOCK_N]

    best = tl.zeros([BLOCK_N], dtype=tl.float32)          # probabilities are >= 0
    for kvh in range(0, H_KV):
        head = kvh * GROUP + g
        q = tl.load(Q + head[:, None] * stride_qh + t[:, None] * stride_qt + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        lse = tl.load(Lse + head * T + t, mask=row_ok, other=0.0)
        k = tl.load(K + kvh * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST_DOT:
            q = q.to(tl.float32)
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        p = tl.where(visible, tl.math.exp2(s - lse[:, None]), 0.0)                      # [M, BLOCK_N]
        per_head = tl.sum(tl.reshape(p, (G_P2, T_P2, BLOCK_N)), 1) * (1.0 / T)          # [G_P2, BLOCK_N]
        best = tl.maximum(best, tl.max(per_head, 0))
    tl.store(Scores + offs_n, best, mask=n_ok)


def score_tail_queries_triton(q_tail: torch.Tensor, k: torch.Tensor, scale: float, *, block_n: int = 64,
                              num_splits: int | None = None) -> torch.Tensor:
    """-> [S] float32. Shapes are validated by the public wrapper."""
    Hq, T, D = q_tail.shape
    Hkv, S, _ = k.shape
    G = Hq // Hkv
    g_p2 = triton.next_power_of_2(G)
    t_p2 = max(triton.next_power_of_2(T), triton.cdiv(16, g_p2))     # tile rows >= 16 for tl.dot
    if num_splits is None:
        sms = multiprocessor_count(k.device)
        num_splits = max(1, min(triton.cdiv(S, block_n), triton.cdiv(4 * sms, Hkv)))
    split_len = triton.cdiv(triton.cdiv(S, num_splits), block_n) * block_n
    num_splits = triton.cdiv(S, split_len)                          # no empty splits
    upcast, precision = dot_flags(q_tail.dtype)
    qk_scale = scale * LOG2E
    num_warps = 4 if g_p2 * t_p2 <= 64 else 8
    common = dict(T=T, GROUP=G, HEAD_DIM=D, G_P2=g_p2, T_P2=t_p2, BLOCK_N=block_n,
                  BLOCK_D=triton.next_power_of_2(D), UPCAST_DOT=upcast, DOT_PRECISION=precision)

    l_part = torch.empty(Hq, T, num_splits, dtype=torch.float32, device=k.device)
    _tail_lse_kernel[(num_splits, Hkv)](
        q_tail, k, l_part, qk_scale, S, split_len,
        q_tail.stride(0), q_tail.stride(1), k.stride(0), k.stride(1),
        NUM_SPLITS=num_splits, num_warps=num_warps, **common,
    )
    lse = torch.logsumexp(l_part * math.log(2.0), dim=-1) * LOG2E       # [Hq, T], log2 units
    scores = torch.empty(S, dtype=torch.float32, device=k.device)
    _tail_probs_kernel[(triton.cdiv(S, block_n),)](
        q_tail, k, lse, scores, qk_scale, S,
        q_tail.stride(0), q_tail.stride(1), k.stride(0), k.stride(1),
        Hkv, num_warps=num_warps, **common,
    )
    return scores
