"""RMSNorm (optionally after a residual add) with one program per row and one fixed reduction
order, whatever the number of rows: a decode step (1 row) and a verify step (q + 1 rows) normalise
a given row bit for bit alike. torch.compile specialises 1-row shapes and may split a long row's
reduction across programs there, which moves the last bits between the two."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchd.kernels._backend import interpreting, launch_options, patch_interpreter_index, pdl_enabled
from batchd.kernels._pdl import AFTER_WAIT, pdl_wait

if interpreting():
    patch_interpreter_index()


@triton.jit
def _rms_norm_kernel(X, Res, W, Out, HOut, eps, H, stride_x, stride_r, stride_o, stride_h,
                     HAS_RES: tl.constexpr, USE_PDL: tl.constexpr, BLOCK: tl.constexpr):
    pdl_wait(USE_PDL, AFTER_WAIT)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < H
    dtype = X.dtype.element_ty
    h = tl.load(X + row * stride_x + offs, mask=ok, other=0.0)
    if HAS_RES:
        h = (h.to(tl.float32) + tl.load(Res + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)).to(dtype)
        tl.store(HOut + row * stride_h + offs, h, mask=ok)
    h32 = h.to(tl.float32)
    inv = tl.rsqrt(tl.sum(h32 * h32, 0) / H + eps)
    w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
    y = w * (h32 * inv).to(dtype).to(tl.float32)
    tl.store(Out + row * stride_o + offs, y.to(dtype), mask=ok)


def rms_norm_triton(x, weight, eps, residual=None):
    H = x.shape[-1]
    rows = x.reshape(-1, H)
    out = torch.empty_like(rows)
    res = residual.reshape(-1, H) if residual is not None else rows
    h_out = torch.empty_like(rows) if residual is not None else rows
    block = triton.next_power_of_2(H)
    pdl = pdl_enabled(x.device)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, res, weight, out, h_out, eps, H,
        rows.stride(0), res.stride(0), out.stride(0), h_out.stride(0),
        HAS_RES=residual is not None, USE_PDL=pdl, BLOCK=block, num_warps=4 if block <= 2048 else 8,
        **launch_options(pdl),
    )
    return out.view(x.shape), (h_out.view(x.shape) if residual is not None else x)


@triton.jit
def _rms_norm_f32_kernel(X, W, Out, eps, H, stride_x, stride_o, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    """One row: weight * x / rms(x), all in float32, rounded once to Out's dtype."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < H
    x = tl.load(X + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    y = x * tl.math.rsqrt(tl.sum(x * x, 0) / H + eps)
    if HAS_WEIGHT:
        y = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32) * y
    tl.store(Out + row * stride_o + offs, y.to(Out.dtype.element_ty), mask=ok)


def rms_norm_f32_triton(x, weight, eps, out_dtype):
    H = x.shape[-1]
    rows = x.reshape(-1, H)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(H)
        _rms_norm_f32_kernel[(rows.shape[0],)](
            rows, weight if weight is not None else rows, out, eps, H, rows.stride(0), out.stride(0),
            HAS_WEIGHT=weight is not None, BLOCK=block, num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16,
        )
    return out.view(x.shape)
