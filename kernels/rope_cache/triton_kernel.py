"""One launch for what follows the q/k/v projection of a decode or verify step: optional per-head
RMSNorm (qwen3), rotary embedding of q and k, and the k/v rows written into the cache.

Program (row b*T + t, head h) handles one head vector: heads [0, Hq) are queries (rotated into the
output), heads [Hq, Hq + Hkv) are key/value pairs (k rotated, both stored at cache row positions[t]).
Eagerly this was four to six launches per layer; at batch 1 launches, not bytes, cost the time.

That grid suits decode and verify (1..17 rows); a prefill chunk of thousands of rows makes it tens
of thousands of one-warp programs of 64-256 bytes each, latency-bound (about 80 us a layer at 4,096
rows of Qwen2.5-0.5B on the H200, 40x off copy bandwidth). From ROW_BLOCK_MIN_ROWS rows without the
per-head norm, `_rope_and_store_rows_kernel` takes over: program (row block, head, b) handles
BLOCK_ROWS rows of one head as [BLOCK_ROWS, D/2] tiles with the same per-element arithmetic
(`rope_rows_at`, `rotate_with`), so its outputs are bit for bit the per-row kernel's and a row's
bits do not depend on which kernel ran. The norm case keeps the per-row kernel: a 2-D tile's
row reductions could be ordered differently from the 1-D one.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchd.kernels._backend import interpreting, launch_options, patch_interpreter_index, pdl_enabled
from batchd.kernels._pdl import AFTER_WAIT, pdl_wait

if interpreting():
    patch_interpreter_index()


@triton.jit
def rope_rows_at(cos_ptrs, sin_ptrs, HALF: tl.constexpr, mask, dtype: tl.constexpr):
    """The rope table values a head's halves need: cos and sin at cos_ptrs, sin_ptrs (dims d) and
    + HALF, rounded to the model dtype as the eager path's tables are, in float32. The loads skip
    L1 (".cg"): the q/k/v projection may issue them before its griddepcontrol.wait (kernels._pdl)."""
    cos1 = tl.load(cos_ptrs, mask=mask, other=0.0, cache_modifier=".cg").to(dtype).to(tl.float32)
    cos2 = tl.load(cos_ptrs + HALF, mask=mask, other=0.0, cache_modifier=".cg").to(dtype).to(tl.float32)
    sin1 = tl.load(sin_ptrs, mask=mask, other=0.0, cache_modifier=".cg").to(dtype).to(tl.float32)
    sin2 = tl.load(sin_ptrs + HALF, mask=mask, other=0.0, cache_modifier=".cg").to(dtype).to(tl.float32)
    return cos1, cos2, sin1, sin2


@triton.jit
def rotate_with(x1, x2, cos1, cos2, sin1, sin2):
    """Rope of a head's halves x1 (dims d) and x2 (dims d + D/2), float32, with `rope_rows_at`'s
    values: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]. The fused multiply-adds are spelled out:
    left to the compiler, which product it fused followed the order the operands were computed in,
    so the q/k/v projection's epilogue (tables read first) and this kernel (tables read last)
    differed in float32 (measured on the H200)."""
    return tl.fma(x1, cos1, -(x2 * sin1)), tl.fma(x2, cos2, x1 * sin2)


@triton.jit
def rotate_half(x1, x2, cos_ptrs, sin_ptrs, HALF: tl.constexpr, mask, dtype: tl.constexpr):
    """`rotate_with` the table values at cos_ptrs, sin_ptrs. Shared by this kernel and the q/k/v
    projection's epilogue (kernels.small_matmul), so both give the same bits."""
    cos1, cos2, sin1, sin2 = rope_rows_at(cos_ptrs, sin_ptrs, HALF, mask, dtype)
    return rotate_with(x1, x2, cos1, cos2, sin1, sin2)


@triton.jit
def _rope_and_store_kernel(
    QKV, Cos, Sin, Pos, QNorm, KNorm, QOut, KCache, VCache,
    T, eps,
    stride_qkv_row,                       # QKV [B*T, (Hq + 2 Hkv) * D], row stride
    stride_qo_b, stride_qo_h, stride_qo_t,  # QOut [B, Hq, T, D]
    stride_cb, stride_ch, stride_cn,      # caches [B, Hkv, S_max, D]
    HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    USE_NORM: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL, AFTER_WAIT)
    row = tl.program_id(0)                # b * T + t
    head = tl.program_id(1)
    b = row // T
    t = row % T
    offs = tl.arange(0, HALF)
    is_query = head < HQ
    col = head * HEAD_DIM                 # queries, then keys, in the fused projection
    base = QKV + row * stride_qkv_row + col
    x1 = tl.load(base + offs).to(tl.float32)
    x2 = tl.load(base + HALF + offs).to(tl.float32)
    dtype = QKV.dtype.element_ty
    if USE_NORM:
        inv = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / HEAD_DIM + eps)
        if is_query:
            w1 = tl.load(QNorm + offs).to(tl.float32)
            w2 = tl.load(QNorm + HALF + offs).to(tl.float32)
        else:
            w1 = tl.load(KNorm + offs).to(tl.float32)
            w2 = tl.load(KNorm + HALF + offs).to(tl.float32)
        # as the eager norm: normalise in float32, round to the model dtype, then scale
        x1 = (w1 * (x1 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    y1, y2 = rotate_half(x1, x2, Cos + t * HEAD_DIM + offs, Sin + t * HEAD_DIM + offs, HALF, True, dtype)
    if is_query:
        out = QOut + b * stride_qo_b + head * stride_qo_h + t * stride_qo_t
        tl.store(out + offs, y1.to(QOut.dtype.element_ty))
        tl.store(out + HALF + offs, y2.to(QOut.dtype.element_ty))
    else:
        kvh = head - HQ
        pos = tl.load(Pos + t)
        dst = b * stride_cb + kvh * stride_ch + pos * stride_cn
        tl.store(KCache + dst + offs, y1.to(KCache.dtype.element_ty))
        tl.store(KCache + dst + HALF + offs, y2.to(KCache.dtype.element_ty))
        v_src = QKV + row * stride_qkv_row + (HQ + HKV + kvh) * HEAD_DIM
        tl.store(VCache + dst + offs, tl.load(v_src + offs))
        tl.store(VCache + dst + HALF + offs, tl.load(v_src + HALF + offs))


@triton.jit
def _rope_and_store_rows_kernel(
    QKV, Cos, Sin, Pos, QOut, KCache, VCache,
    T,
    stride_qkv_row,                       # QKV [B*T, (Hq + 2 Hkv) * D], row stride
    stride_qo_b, stride_qo_h, stride_qo_t,  # QOut [B, Hq, T, D]
    stride_cb, stride_ch, stride_cn,      # caches [B, Hkv, S_max, D]
    HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, USE_PDL: tl.constexpr,
):
    """`_rope_and_store_kernel` without the norm for BLOCK_ROWS rows t of one head of sequence b:
    every element goes through the same loads, casts and `rotate_with` as there."""
    pdl_wait(USE_PDL, AFTER_WAIT)
    head = tl.program_id(1)
    b = tl.program_id(2)
    t = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)       # [BLOCK_ROWS]
    ok = (t < T)[:, None]                                                 # [BLOCK_ROWS, 1]
    offs = tl.arange(0, HALF)[None, :]                                    # [1, HALF]
    is_query = head < HQ
    row_base = QKV + ((b * T + t).to(tl.int64) * stride_qkv_row)[:, None]   # [BLOCK_ROWS, 1]
    base = row_base + head * HEAD_DIM
    x1 = tl.load(base + offs, mask=ok).to(tl.float32)                     # [BLOCK_ROWS, HALF]
    x2 = tl.load(base + HALF + offs, mask=ok).to(tl.float32)
    dtype = QKV.dtype.element_ty
    table = (t * HEAD_DIM)[:, None] + offs
    cos1, cos2, sin1, sin2 = rope_rows_at(Cos + table, Sin + table, HALF, ok, dtype)
    y1, y2 = rotate_with(x1, x2, cos1, cos2, sin1, sin2)
    if is_query:
        out = QOut + (b.to(tl.int64) * stride_qo_b + head * stride_qo_h + t.to(tl.int64) * stride_qo_t)[:, None]
        tl.store(out + offs, y1.to(QOut.dtype.element_ty), mask=ok)
        tl.store(out + HALF + offs, y2.to(QOut.dtype.element_ty), mask=ok)
    else:
        kvh = head - HQ
        pos = tl.load(Pos + t, mask=t < T, other=0)                       # [BLOCK_ROWS] cache rows
        dst = (b.to(tl.int64) * stride_cb + kvh * stride_ch + pos.to(tl.int64) * stride_cn)[:, None] + offs
        tl.store(KCache + dst, y1.to(KCache.dtype.element_ty), mask=ok)
        tl.store(KCache + dst + HALF, y2.to(KCache.dtype.element_ty), mask=ok)
        v_src = row_base + (HQ + HKV + kvh) * HEAD_DIM + offs
        tl.store(VCache + dst, tl.load(v_src, mask=ok), mask=ok)
        tl.store(VCache + dst + HALF, tl.load(v_src + HALF, mask=ok), mask=ok)


# From this many rows (B * T) the row-block kernel runs (without the norm). Below it the per-row
# grid already has few programs, and decode and verify steps keep their launch as it was.
ROW_BLOCK_MIN_ROWS = 64


def row_block_rows(head_dim: int) -> int:
    """Rows per program of the row-block kernel: tiles of 2,048 elements per half (64 rows at head
    dim 64, 32 at 128), at least 16 rows."""
    return max(16, 4096 // head_dim)


def rope_and_store_triton(qkv, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads,
                          q_norm=None, k_norm=None, eps=1e-6):
    """qkv [B, T, (Hq + 2 Hkv) D] contiguous -> q [B, Hq, T, D]; the row-block kernel from
    ROW_BLOCK_MIN_ROWS rows when there is no per-head norm, else the per-row kernel."""
    B, T, _ = qkv.shape
    if q_norm is None and B * T >= ROW_BLOCK_MIN_ROWS:
        return launch_row_blocks(qkv, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads)
    return launch_per_row(qkv, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads, q_norm, k_norm, eps)


def launch_row_blocks(qkv, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads):
    """`_rope_and_store_rows_kernel` over grid (row blocks of T, Hq + Hkv heads, B)."""
    B, T, width = qkv.shape
    D = k_cache.shape[-1]
    rows = qkv.reshape(B * T, width)
    q_out = torch.empty(B, num_heads, T, D, dtype=qkv.dtype, device=qkv.device)
    block_rows = row_block_rows(D)
    pdl = pdl_enabled(qkv.device)
    _rope_and_store_rows_kernel[(triton.cdiv(T, block_rows), num_heads + num_kv_heads, B)](
        rows, cos, sin, positions, q_out, k_cache, v_cache,
        T,
        rows.stride(0),
        q_out.stride(0), q_out.stride(1), q_out.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HQ=num_heads, HKV=num_kv_heads, HEAD_DIM=D, HALF=D // 2, BLOCK_ROWS=block_rows, USE_PDL=pdl,
        num_warps=4, **launch_options(pdl),
    )
    return q_out


def launch_per_row(qkv, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads,
                   q_norm=None, k_norm=None, eps=1e-6):
    """`_rope_and_store_kernel` over grid (B * T rows, Hq + Hkv heads)."""
    B, T, width = qkv.shape
    D = k_cache.shape[-1]
    rows = qkv.reshape(B * T, width)
    q_out = torch.empty(B, num_heads, T, D, dtype=qkv.dtype, device=qkv.device)
    use_norm = q_norm is not None
    pdl = pdl_enabled(qkv.device)
    _rope_and_store_kernel[(B * T, num_heads + num_kv_heads)](
        rows, cos, sin, positions, q_norm if use_norm else rows, k_norm if use_norm else rows,
        q_out, k_cache, v_cache,
        T, eps,
        rows.stride(0),
        q_out.stride(0), q_out.stride(1), q_out.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HQ=num_heads, HKV=num_kv_heads, HEAD_DIM=D, HALF=D // 2, USE_NORM=use_norm, USE_PDL=pdl,
        num_warps=1, **launch_options(pdl),
    )
    return q_out
