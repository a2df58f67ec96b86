"""One launch for what follows a batch's q/k/v projection: rope of q and k, and the rotated k plus v
written into the paged pool (engine.batch.rows and engine.batch.chunks; eagerly about seven
kernels for each rotation and two index writes).

Program (row block, head) handles BLOCK_ROWS rows of one head as [BLOCK_ROWS, HALF] tiles of the
two halves of D: heads [0, Hq) are queries (rotated into the output), heads [Hq, Hq + Hkv) are
key/value pairs (k rotated, both stored at their row's pool slot). Every element is computed alone,
so a row's bits depend on nothing else in the launch.

Roundings, as the eager `x * cos + cat([-x2, x1]) * sin` in the model dtype: the tables are
rounded to that dtype, each product is computed in float32 and rounded to it, the sum is computed
in float32 and rounded. In float32 the "rounding" between product and sum is no instruction, and
a compiler would contract the pair into one fused multiply-add (one rounding, not two: not eager's
bits), so the kernel is compiled with `enable_fp_fusion=False`. (kernels.rope_cache goes the
other way: it spells its FMAs out, giving its own, non-eager, bits in float32.)
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
def rotate_rounded(x1, x2, cos1, cos2, sin1, sin2, dtype: tl.constexpr):
    """[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin] with eager's roundings (module docstring); all
    float32 holding `dtype` values, results rounded to `dtype`."""
    a1 = (x1 * cos1).to(dtype).to(tl.float32)
    b1 = (x2 * sin1).to(dtype).to(tl.float32)
    a2 = (x2 * cos2).to(dtype).to(tl.float32)
    b2 = (x1 * sin2).to(dtype).to(tl.float32)
    return (a1 + -b1).to(dtype), (a2 + b2).to(dtype)


@triton.jit
def _rope_paged_kernel(
    Q, K, V, Cos, Sin, QOut, KPool, VPool, Blocks, Offsets,
    N,
    stride_qn, stride_qh,                 # Q [N, Hq, D]
    stride_kn, stride_kh,                 # K [N, Hkv, D]
    stride_vn, stride_vh,                 # V [N, Hkv, D]
    stride_cos, stride_sin,               # Cos, Sin [N, D] float32
    stride_on, stride_oh,                 # QOut [N, Hq, D]
    stride_pb, stride_ph, stride_ps,      # pools [blocks + 1, Hkv, block_size, D]
    HQ: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL, AFTER_WAIT)
    head = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)        # [BLOCK_ROWS]
    rows64 = rows.to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)[None, :]                               # [1, BLOCK_HALF]
    ok = (rows < N)[:, None] & (offs < HALF)                               # [BLOCK_ROWS, BLOCK_HALF]
    dtype = Q.dtype.element_ty
    cos_at = Cos + (rows64 * stride_cos)[:, None] + offs
    sin_at = Sin + (rows64 * stride_sin)[:, None] + offs
    cos1 = tl.load(cos_at, mask=ok, other=0.0).to(dtype).to(tl.float32)
    cos2 = tl.load(cos_at + HALF, mask=ok, other=0.0).to(dtype).to(tl.float32)
    sin1 = tl.load(sin_at, mask=ok, other=0.0).to(dtype).to(tl.float32)
    sin2 = tl.load(sin_at + HALF, mask=ok, other=0.0).to(dtype).to(tl.float32)
    if head < HQ:
        src = Q + (rows64 * stride_qn)[:, None] + head * stride_qh + offs
        x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
        y1, y2 = rotate_rounded(x1, x2, cos1, cos2, sin1, sin2, dtype)
        dst = QOut + (rows64 * stride_on)[:, None] + head * stride_oh + offs
        tl.store(dst, y1, mask=ok)
        tl.store(dst + HALF, y2, mask=ok)
    else:
        kvh = head - HQ
        src = K + (rows64 * stride_kn)[:, None] + kvh * stride_kh + offs
        x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
        y1, y2 = rotate_rounded(x1, x2, cos1, cos2, sin1, sin2, dtype)
        block = tl.load(Blocks + rows, mask=rows < N, other=0).to(tl.int64)      # [BLOCK_ROWS]
        offset = tl.load(Offsets + rows, mask=rows < N, other=0).to(tl.int64)
        slot = (block * stride_pb + kvh * stride_ph + offset * stride_ps)[:, None] + offs
        pool_dtype = KPool.dtype.element_ty
        tl.store(KPool + slot, y1.to(pool_dtype), mask=ok)
        tl.store(KPool + slot + HALF, y2.to(pool_dtype), mask=ok)
        v_src = V + (rows64 * stride_vn)[:, None] + kvh * stride_vh + offs
        tl.store(VPool + slot, tl.load(v_src, mask=ok).to(pool_dtype), mask=ok)
        tl.store(VPool + slot + HALF, tl.load(v_src + HALF, mask=ok).to(pool_dtype), mask=ok)


def block_rows(half: int) -> int:
    """Rows per program: tiles of up to 2,048 elements per half (32 rows at head dim 128, 64 at 64)."""
    return max(1, min(64, 2048 // triton.next_power_of_2(half)))


def rope_paged_store_triton(q, k, v, cos, sin, k_pool, v_pool, write_blocks, write_offsets) -> torch.Tensor:
    """q [N, Hq, D], k, v [N, Hkv, D] with unit stride along D; cos, sin [N, D] contiguous -> q [N, Hq, D]."""
    N, Hq, D = q.shape
    Hkv = k.shape[1]
    q_out = torch.empty(N, Hq, D, dtype=q.dtype, device=q.device)
    if N == 0:
        return q_out
    half = D // 2
    rows = min(block_rows(half), triton.next_power_of_2(N))
    pdl = pdl_enabled(q.device)
    _rope_paged_kernel[(triton.cdiv(N, rows), Hq + Hkv)](
        q, k, v, cos, sin, q_out, k_pool, v_pool, write_blocks, write_offsets,
        N,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0),
        q_out.stride(0), q_out.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        HQ=Hq, HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_ROWS=rows, USE_PDL=pdl,
        num_warps=4, enable_fp_fusion=False, **launch_options(pdl),
    )
    return q_out
