"""Grouped MoE experts in Triton: token-expert pairs sorted by expert, tiles only where experts have tokens.

Three launches (plan_blocks before them is a few small torch ops, no host sync):

1. gate/up: program (block, n) multiplies a BLOCK_M tile of one expert's pairs (their tokens' rows
   of x, gathered) by BLOCK_N gate rows and the matching BLOCK_N up rows of that expert's
   [2I, H] weight, then applies V4's clamped SwiGLU -> act [P, I] in x's dtype, in sorted order.
2. down: program (block, n) multiplies the tile's act rows by BLOCK_N rows of the expert's [H, I]
   weight, scales each row by its routing weight and writes it, in float32, to its pair's own
   row of pair_out [N * k, H] (pair = token * k + slot: the scatter back to the token).
3. sum: out[t] = pair_out[t, 0] + pair_out[t, 1] + ... in slot order, cast to x's dtype.

Batch invariance (a token's output never depends on the other tokens of the call): BLOCK_M and
BLOCK_K are fixed per weight shape (choose_config), never by the token count, and there is no
split-K, so each output element is one float32 sum over K in BLOCK_K steps in increasing order;
the rows of a tile do not mix (tl.dot rows are independent, and the interpreter's dot is made
so: kernels._backend). The k experts of a token are summed by slot, not by arrival (no atomics).

Only blocks that hold pairs read weights: the grid is the most blocks any routing could need
(max_blocks), and the unused tail exits before touching memory, so at batch 1 the kernels read
the k active experts' weights and nothing else. Nothing syncs the host (a CUDA graph can hold it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from batchd.kernels._backend import interpreting, patch_interpreter_index

if interpreting():
    patch_interpreter_index()


@dataclass(frozen=True)
class MoeConfig:
    block_m: int = 16          # pairs a tile; fixed per shape (batch invariance), >= 16 for tl.dot
    gate_up_block_n: int = 32  # gate rows a program (and as many up rows)
    down_block_n: int = 64     # output columns a program
    block_k: int = 128         # the reduction step of both matmuls
    num_warps: int = 4
    num_stages: int = 3


def choose_config(H: int, I: int, dtype: torch.dtype) -> MoeConfig:
    """One config per (H, I, dtype), never per token count. BLOCK_K spans 256 bytes of a weight row;
    narrow gate/up tiles give V4-Flash's 6 active experts at batch 1 about 400 programs a launch
    (I / 32 x 6 = 384 for gate/up, H / 64 x 6 = 384 for down) on the H200's 132 SMs. Untuned."""
    return MoeConfig(block_k=256 // dtype.itemsize)


class ExpertBlocks(NamedTuple):
    """The tile schedule: pairs sorted by expert (stable, so by token within an expert), cut into
    tiles of block_m pairs that never straddle two experts."""
    sorted_pairs: torch.Tensor   # [P] int32 pair ids (token * k + slot), grouped by expert
    expert: torch.Tensor         # [max_blocks] int32 expert of each tile
    begin: torch.Tensor          # [max_blocks] int32 first sorted position of each tile
    end: torch.Tensor            # [max_blocks] int32 one past its last (== begin: an unused tile)


def max_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """Tiles the worst routing needs: every used expert may add one partial tile."""
    return triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m)


def plan_blocks(experts: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """experts [N, k] -> ExpertBlocks, on the experts' device, without reading anything back."""
    flat = experts.reshape(-1).long()
    P = flat.numel()
    sorted_pairs = torch.sort(flat, stable=True).indices.to(torch.int32)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))       # [E] pairs an expert (bincount would sync)
    ends = counts.cumsum(0)                                   # [E] one past each expert's last sorted pair
    tiles = (counts + block_m - 1) // block_m
    tile_ends = tiles.cumsum(0)                               # [E]
    block = torch.arange(max_blocks(P, num_experts, block_m), device=flat.device)
    expert = torch.searchsorted(tile_ends, block, right=True).clamp(max=num_experts - 1)   # [max_blocks]
    begin = ends[expert] - counts[expert] + (block - (tile_ends[expert] - tiles[expert])) * block_m
    end = torch.minimum(ends[expert], begin + block_m)
    used = block < tile_ends[-1]
    begin, end = torch.where(used, begin, 0), torch.where(used, end, 0)
    return ExpertBlocks(sorted_pairs, expert.to(torch.int32), begin.to(torch.int32), end.to(torch.int32))


@triton.jit
def _tile_rows(SortedPairs, Begin, End, blk, BLOCK_M: tl.constexpr):
    """(sorted positions [BLOCK_M], their pair ids, which are real, whether the tile has any)."""
    begin = tl.load(Begin + blk)
    end = tl.load(End + blk)
    rows = begin + tl.arange(0, BLOCK_M)
    ok = rows < end
    pairs = tl.load(SortedPairs + rows, mask=ok, other=0).to(tl.int64)
    return rows.to(tl.int64), pairs, ok, end > begin


@triton.jit
def _gate_up_kernel(X, W, Act, SortedPairs, Expert, Begin, End, H, I, limit,
                    stride_x, stride_we, stride_wn, stride_a,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    blk, nb = tl.program_id(0), tl.program_id(1)
    rows, pairs, ok, busy = _tile_rows(SortedPairs, Begin, End, blk, BLOCK_M)
    if busy:
        tokens = pairs // TOP_K
        w = W + tl.load(Expert + blk).to(tl.int64) * stride_we
        cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < I
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < H
            x = tl.load(X + tokens[:, None] * stride_x + ks[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
            w_ok = k_ok[:, None] & col_ok[None, :]
            wg = tl.load(w + cols[None, :].to(tl.int64) * stride_wn + ks[:, None], mask=w_ok, other=0.0)  # [BK, BN]
            wu = tl.load(w + (cols[None, :] + I).to(tl.int64) * stride_wn + ks[:, None], mask=w_ok, other=0.0)
            if UPCAST:
                x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            acc_g = tl.dot(x, wg, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(x, wu, acc_u, input_precision=PRECISION)
        gate = tl.minimum(acc_g, limit)
        up = tl.minimum(tl.maximum(acc_u, -limit), limit)
        act = gate * tl.sigmoid(gate) * up
        tl.store(Act + rows[:, None] * stride_a + cols[None, :], act.to(Act.dtype.element_ty),
                 mask=ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(Act, W, RouteWeights, PairOut, SortedPairs, Expert, Begin, End, H, I,
                 stride_a, stride_we, stride_wn, stride_p,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    blk, nb = tl.program_id(0), tl.program_id(1)
    rows, pairs, ok, busy = _tile_rows(SortedPairs, Begin, End, blk, BLOCK_M)
    if busy:
        w = W + tl.load(Expert + blk).to(tl.int64) * stride_we
        cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < H
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < I
            a = tl.load(Act + rows[:, None] * stride_a + ks[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
            wd = tl.load(w + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                         mask=k_ok[:, None] & col_ok[None, :], other=0.0)                                   # [BK, BN]
            if UPCAST:
                a, wd = a.to(tl.float32), wd.to(tl.float32)
            acc = tl.dot(a, wd, acc, input_precision=PRECISION)
        route = tl.load(RouteWeights + pairs, mask=ok, other=0.0).to(tl.float32)
        tl.store(PairOut + pairs[:, None] * stride_p + cols[None, :], acc * route[:, None],
                 mask=ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_slots_kernel(PairOut, Out, H, stride_p, stride_o, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    token, nb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = nb * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    first = PairOut + token * TOP_K * stride_p
    total = tl.load(first + cols, mask=ok, other=0.0)
    for slot in tl.static_range(1, TOP_K):
        total += tl.load(first + slot * stride_p + cols, mask=ok, other=0.0)
    tl.store(Out + token * stride_o + cols, total.to(Out.dtype.element_ty), mask=ok)


def moe_experts_triton(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                       down: torch.Tensor, limit: float, config: MoeConfig | None = None) -> torch.Tensor:
    """See kernels.moe_experts.moe_experts; x, gate_up and down share a dtype, rows contiguous."""
    N, H = x.shape
    E, I, k = down.shape[0], down.shape[2], experts.shape[1]
    config = config or choose_config(H, I, x.dtype)
    plan = plan_blocks(experts, E, config.block_m)
    blocks = plan.expert.shape[0]
    upcast = interpreting() and x.dtype == torch.bfloat16   # the interpreter multiplies bf16 tiles as integers
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    launch = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    act = torch.empty(N * k, I, dtype=x.dtype, device=x.device)                # [P, I] in sorted order
    _gate_up_kernel[(blocks, triton.cdiv(I, config.gate_up_block_n))](
        x, gate_up, act, plan.sorted_pairs, plan.expert, plan.begin, plan.end, H, I, float(limit),
        x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        TOP_K=k, BLOCK_M=config.block_m, BLOCK_N=config.gate_up_block_n, BLOCK_K=config.block_k,
        UPCAST=upcast, PRECISION=precision, **launch)
    pair_out = torch.empty(N * k, H, dtype=torch.float32, device=x.device)    # [P, H] by pair id
    route = weights.reshape(-1).contiguous()
    _down_kernel[(blocks, triton.cdiv(H, config.down_block_n))](
        act, down, route, pair_out, plan.sorted_pairs, plan.expert, plan.begin, plan.end, H, I,
        act.stride(0), down.stride(0), down.stride(1), pair_out.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.down_block_n, BLOCK_K=config.block_k,
        UPCAST=upcast, PRECISION=precision, **launch)
    out = torch.empty_like(x)
    sum_block = min(1024, triton.next_power_of_2(H))
    _sum_slots_kernel[(N, triton.cdiv(H, sum_block))](pair_out, out, H, pair_out.stride(0), out.stride(0),
                                                       TOP_K=k, BLOCK=sum_block, num_warps=4)
    return out
