"""Two-pass argmax: program (row, block) finds its block's maximum and the first index holding it;
one program per row then takes the largest of those, the lowest index among equals (blocks are in
index order, so that is the first occurrence in the row)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchd.kernels._backend import launch_options, pdl_enabled
from batchd.kernels._pdl import AFTER_WAIT, pdl_wait

BLOCK = 2048


@triton.jit
def _block_argmax_kernel(X, BestVal, BestIdx, V, stride_x, NUM_BLOCKS, USE_PDL: tl.constexpr, BLOCK: tl.constexpr):
    # X [M, V]; BestVal [M, NUM_BLOCKS] f32; BestIdx [M, NUM_BLOCKS] int32
    pdl_wait(USE_PDL, AFTER_WAIT)  # the logits come from the kernel before
    row = tl.program_id(0)
    block = tl.program_id(1)
    idx = block * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_x + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
    best = tl.max(x, 0)
    first = tl.min(tl.where(x == best, idx, V), 0)   # all -inf: the block's first index
    first = tl.where(best == float("-inf"), block * BLOCK, first)
    tl.store(BestVal + row * NUM_BLOCKS + block, best)
    tl.store(BestIdx + row * NUM_BLOCKS + block, first)


@triton.jit
def _row_argmax_kernel(BestVal, BestIdx, Out, Picked, NextToken, Length, NUM_BLOCKS, USE_PDL: tl.constexpr,
                       RECORD: tl.constexpr, BLOCKS_P2: tl.constexpr):
    # Out [M] int64; with RECORD (M = 1, the greedy chain): Picked [max_len] int64, NextToken [1],
    # Length [1] int64: picked[length] = id, next_token = id, length += 1
    pdl_wait(USE_PDL, AFTER_WAIT)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCKS_P2)
    ok = offs < NUM_BLOCKS
    val = tl.load(BestVal + row * NUM_BLOCKS + offs, mask=ok, other=float("-inf"))
    idx = tl.load(BestIdx + row * NUM_BLOCKS + offs, mask=ok, other=2147483647)
    best = tl.max(val, 0)
    picked = tl.min(tl.where(ok & (val == best), idx, 2147483647), 0).to(tl.int64)
    if RECORD:
        length = tl.load(Length)
        tl.store(Picked + length, picked)
        tl.store(NextToken, picked)
        tl.store(Length, length + 1)
    else:
        tl.store(Out + row, picked)


def argmax_rows_triton(logits: torch.Tensor, record=None) -> torch.Tensor | None:
    """-> ids [M]; with record = (picked, next_token, length) (M = 1) the second launch writes the
    id there and advances length instead, and nothing is returned."""
    M, V = logits.shape
    blocks = triton.cdiv(V, BLOCK)
    best_val = torch.empty(M, blocks, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(M, blocks, dtype=torch.int32, device=logits.device)
    out = torch.empty(M, dtype=torch.int64, device=logits.device) if record is None else None
    picked, next_token, length = record if record is not None else (out, out, out)
    pdl = pdl_enabled(logits.device)
    _block_argmax_kernel[(M, blocks)](logits, best_val, best_idx, V, logits.stride(0), blocks, USE_PDL=pdl,
                                      BLOCK=BLOCK, num_warps=8, **launch_options(pdl))
    _row_argmax_kernel[(M,)](best_val, best_idx, out if out is not None else picked, picked, next_token, length,
                             blocks, USE_PDL=pdl, RECORD=record is not None,
                             BLOCKS_P2=max(16, triton.next_power_of_2(blocks)), num_warps=4, **launch_options(pdl))
    return out


__all__ = ["argmax_rows_triton", "BLOCK"]
