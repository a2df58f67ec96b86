"""The hyper-connection kernels: one program per token row, so a row's bits never depend on the
rows beside it (a decode row and the same row in a verify step agree), and one launch where the
eager ops took about 130 (Sinkhorn's 20 iterations alone are 117 tiny kernels).

hc_split: the mixes' sigmoids, softmax and Sinkhorn on an [NP, NP] tile (NP = n rounded up to a
power of two, padding masked to zero), then the block input sum_j pre_j streams_j over H in
BLOCK_H slices. hc_merge: a [NP, BLOCK_H] tile of the streams per program, each output stream's
mix a reduction over the tile's stream axis.

exp is libdevice's expf and divisions IEEE (div_rn) compiled, as eager PyTorch's CUDA kernels;
the interpreter takes numpy's float32 exp. Sums run in float32; their order is the kernel's own
(fixed, whatever the number of rows), so the results are the twin's to within float32 rounding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from batchd.kernels._backend import interpreting, patch_interpreter_index

if interpreting():
    patch_interpreter_index()


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _sigmoid(x, LIBDEVICE: tl.constexpr):
    return tl.math.div_rn(1.0, 1.0 + _exp(-x, LIBDEVICE))


@triton.jit
def _hc_split_kernel(Mixes, Scale, Base, Streams, Post, Comb, X, H, iters, eps,
                     stride_mix, stride_sr, stride_ss, stride_x,
                     N_STREAMS: tl.constexpr, NP: tl.constexpr, BLOCK_H: tl.constexpr, LIBDEVICE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n: tl.constexpr = N_STREAMS
    i = tl.arange(0, NP)
    ok = i < n
    mix = Mixes + row * stride_mix
    s_pre = tl.load(Scale)
    s_post = tl.load(Scale + 1)
    s_comb = tl.load(Scale + 2)
    pre = _sigmoid(tl.load(mix + i, mask=ok, other=0.0) * s_pre + tl.load(Base + i, mask=ok, other=0.0),
                   LIBDEVICE) + eps                                                            # [NP]
    post = 2.0 * _sigmoid(tl.load(mix + n + i, mask=ok, other=0.0) * s_post
                          + tl.load(Base + n + i, mask=ok, other=0.0), LIBDEVICE)
    tl.store(Post + row * n + i, post, mask=ok)

    square = ok[:, None] & ok[None, :]                                                         # [NP, NP]
    at = i[:, None] * n + i[None, :]
    logits = tl.load(mix + 2 * n + at, mask=square, other=0.0) * s_comb + tl.load(Base + 2 * n + at, mask=square, other=0.0)
    logits = tl.where(square, logits, float("-inf"))
    row_max = tl.where(ok, tl.max(logits, axis=1), 0.0)   # padded rows: all -inf, kept finite
    e = _exp(logits - row_max[:, None], LIBDEVICE)
    total = tl.where(ok, tl.sum(tl.where(square, e, 0.0), axis=1), 1.0)
    comb = tl.where(square, tl.math.div_rn(e, total[:, None]) + eps, 0.0)
    comb = tl.math.div_rn(comb, tl.sum(comb, axis=0)[None, :] + eps)
    for _ in range(iters - 1):
        comb = tl.math.div_rn(comb, tl.sum(comb, axis=1)[:, None] + eps)
        comb = tl.math.div_rn(comb, tl.sum(comb, axis=0)[None, :] + eps)
    tl.store(Comb + row * n * n + at, comb, mask=square)

    h = tl.arange(0, BLOCK_H)
    dtype = X.dtype.element_ty
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + h
        tile_ok = ok[:, None] & (cols < H)[None, :]
        streams = tl.load(Streams + row * stride_sr + i[:, None] * stride_ss + cols[None, :], mask=tile_ok, other=0.0)
        x = tl.sum(pre[:, None] * streams.to(tl.float32), axis=0)                           # [BLOCK_H]
        tl.store(X + row * stride_x + cols, x.to(dtype), mask=cols < H)


@triton.jit
def _hc_merge_kernel(Streams, BlockOut, Post, Comb, Out, H, stride_sr, stride_ss, stride_b, stride_or, stride_os,
                     N_STREAMS: tl.constexpr, NP: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n: tl.constexpr = N_STREAMS
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, NP)
    ok = j < n
    in_h = cols < H
    dtype = Out.dtype.element_ty
    streams = tl.load(Streams + row * stride_sr + j[:, None] * stride_ss + cols[None, :],
                      mask=ok[:, None] & in_h[None, :], other=0.0).to(tl.float32)           # [NP, BLOCK_H]
    block_out = tl.load(BlockOut + row * stride_b + cols, mask=in_h, other=0.0).to(tl.float32)
    for out_stream in tl.static_range(N_STREAMS):
        comb = tl.load(Comb + row * n * n + j * n + out_stream, mask=ok, other=0.0)           # column: [NP]
        mixed = tl.sum(comb[:, None] * streams, axis=0)
        post = tl.load(Post + row * n + out_stream).to(dtype).to(tl.float32)
        spread = (post * block_out).to(dtype).to(tl.float32)
        tl.store(Out + row * stride_or + out_stream * stride_os + cols,
                 (spread + mixed.to(dtype).to(tl.float32)).to(dtype), mask=in_h)


def _block_h(hidden: int) -> int:
    return min(1024, triton.next_power_of_2(hidden))


def hc_split_triton(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, streams: torch.Tensor,
                    iters: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [N, (2 + n) n] float32, streams [N, n, H] (H contiguous) -> (post [N, n], comb [N, n, n], x [N, H])."""
    N, n, H = streams.shape
    post = torch.empty(N, n, dtype=torch.float32, device=streams.device)
    comb = torch.empty(N, n, n, dtype=torch.float32, device=streams.device)
    x = torch.empty(N, H, dtype=streams.dtype, device=streams.device)
    if N:
        _hc_split_kernel[(N,)](
            mixes, scale, base, streams, post, comb, x, H, iters, eps,
            mixes.stride(0), streams.stride(0), streams.stride(1), x.stride(0),
            N_STREAMS=n, NP=triton.next_power_of_2(n), BLOCK_H=_block_h(H), LIBDEVICE=not interpreting(),
            num_warps=4,
        )
    return post, comb, x


def hc_merge_triton(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """streams [N, n, H], block_out [N, H] (H contiguous), post [N, n], comb [N, n, n] float32 contiguous -> [N, n, H]."""
    N, n, H = streams.shape
    out = torch.empty(N, n, H, dtype=streams.dtype, device=streams.device)
    if N:
        block = _block_h(H)
        _hc_merge_kernel[(N, triton.cdiv(H, block))](
            streams, block_out, post, comb, out, H,
            streams.stride(0), streams.stride(1), block_out.stride(0), out.stride(0), out.stride(1),
            N_STREAMS=n, NP=triton.next_power_of_2(n), BLOCK_H=block, num_warps=4,
        )
    return out
