"""Triton kernels of paged decode attention: split programs over (row, KV head, key piece), then
one merge program per (row, query head) that combines the pieces in order.

The query heads sharing a KV head go through one tile ([GP, D], padded to 16 rows for tl.dot), so
each key block is read once per KV head. Every loop runs in a fixed order set by the row's own
length (blocks within a piece, pieces in the merge), so a row's bits never depend on the batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchd.kernels._backend import interpreting, patch_interpreter_index

if interpreting():
    patch_interpreter_index()


@triton.jit
def _paged_split_kernel(Q, K, V, Tables, Lens, M_out, L_out, Acc_out, scale,
                        stride_qn, stride_qh, stride_kb, stride_kh, stride_ks, stride_tn,
                        stride_mn, stride_mh, stride_an, stride_ah, stride_as,
                        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr,
                        SPLIT_BLOCKS: tl.constexpr, UPCAST: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    piece = tl.program_id(2)
    seq_len = tl.load(Lens + row)
    first = piece * SPLIT_BLOCKS
    n_blocks = tl.cdiv(seq_len, BS)
    if first < n_blocks:
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, DP)
        offs_s = tl.arange(0, BS)
        heads = kv_head * G + offs_g
        live = offs_g < G
        d_ok = offs_d < D
        q = tl.load(Q + row * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=live[:, None] & d_ok[None, :], other=0.0)
        # the interpreter's patched tl.dot reads float operands only (bf16 arrives as raw bits)
        dot_dtype = tl.float32 if UPCAST else K.dtype.element_ty
        q = q.to(dot_dtype)
        m = tl.full([GP], float("-inf"), tl.float32)
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        last = tl.minimum(first + SPLIT_BLOCKS, n_blocks)
        for b in range(first, last):
            block = tl.load(Tables + row * stride_tn + b)
            kv = block.to(tl.int64) * stride_kb + kv_head * stride_kh + offs_s[:, None] * stride_ks + offs_d[None, :]
            k = tl.load(K + kv, mask=d_ok[None, :], other=0.0)                 # [BS, DP]
            s = tl.dot(q, tl.trans(k.to(dot_dtype))) * scale                                  # [GP, BS] float32
            s = tl.where((b * BS + offs_s)[None, :] < seq_len, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(V + kv, mask=d_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(dot_dtype), v.to(dot_dtype))
            m = m_new
        at = row * stride_mn + heads * stride_mh + piece
        tl.store(M_out + at, m, mask=live)
        tl.store(L_out + at, l, mask=live)
        tl.store(Acc_out + row * stride_an + heads[:, None] * stride_ah + piece * stride_as + offs_d[None, :], acc,
                 mask=live[:, None] & d_ok[None, :])


@triton.jit
def _paged_merge_kernel(Lens, M_in, L_in, Acc_in, Out, stride_mn, stride_mh, stride_an, stride_ah, stride_as,
                        stride_on, stride_oh, D: tl.constexpr, DP: tl.constexpr, PIECE_KEYS: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    pieces = tl.cdiv(tl.load(Lens + row), PIECE_KEYS)
    offs_d = tl.arange(0, DP)
    d_ok = offs_d < D
    base = row * stride_mn + head * stride_mh
    m_all = tl.load(M_in + base)
    for i in range(1, pieces):
        m_all = tl.maximum(m_all, tl.load(M_in + base + i))
    l_all = 0.0
    acc = tl.zeros([DP], tl.float32)
    for i in range(0, pieces):
        w = tl.exp(tl.load(M_in + base + i) - m_all)
        l_all += tl.load(L_in + base + i) * w
        acc += tl.load(Acc_in + row * stride_an + head * stride_ah + i * stride_as + offs_d, mask=d_ok, other=0.0) * w
    tl.store(Out + row * stride_on + head * stride_oh + offs_d, (acc / l_all).to(Out.dtype.element_ty), mask=d_ok)


def paged_decode_attention_triton(q, k_pool, v_pool, block_tables, seq_lens, *, scale: float, max_seq_len: int,
                                  split_blocks: int) -> torch.Tensor:
    N, Hq, D = q.shape
    _, Hkv, BS, _ = k_pool.shape
    G = Hq // Hkv
    pieces = max(1, triton.cdiv(max_seq_len, BS * split_blocks))
    m = torch.empty((N, Hq, pieces), device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty((N, Hq, pieces, D), device=q.device, dtype=torch.float32)
    out = torch.empty_like(q)
    if N == 0:
        return out
    q = q.contiguous()
    if k_pool.stride(3) != 1 or not k_pool.is_contiguous() or not v_pool.is_contiguous():
        raise ValueError("k_pool and v_pool must be contiguous [blocks, Hkv, block_size, D]")
    _paged_split_kernel[(N, Hkv, pieces)](
        q, k_pool, v_pool, block_tables, seq_lens, m, l, acc, scale,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), block_tables.stride(0),
        m.stride(0), m.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
        G=G, GP=max(16, triton.next_power_of_2(G)), D=D, DP=triton.next_power_of_2(D), BS=BS, SPLIT_BLOCKS=split_blocks,
        UPCAST=interpreting(),
        num_warps=4, num_stages=2,
    )
    _paged_merge_kernel[(N, Hq)](
        seq_lens, m, l, acc, out, m.stride(0), m.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
        out.stride(0), out.stride(1), D=D, DP=triton.next_power_of_2(D), PIECE_KEYS=BS * split_blocks, num_warps=1,
    )
    return out
