"""Batch-invariant many-row linear in Triton: one fixed tile config per weight shape, no split-K.

Program p computes one BLOCK_M x BLOCK_N tile of out = x W^T (+ bias): it walks K in BLOCK_K steps
in increasing order, multiplying a BLOCK_M x BLOCK_K tile of x by a BLOCK_N x BLOCK_K tile of the
weight with tl.dot into a float32 accumulator, adds the bias in float32 and rounds once to x's
dtype. Rows past M and weight rows past N load as zeros and are not stored; columns past K (a
ragged last step) load as zeros on both sides.

Why a row's bits do not depend on M or on its neighbours: the config (tiles, warps, stages, group)
comes from (N, K, dtype) alone (TUNED, else `heuristic_config`; never autotuned: an autotuner
picks per machine and per run), so one compiled kernel serves every M (M is not specialised:
`do_not_specialize`); the MMA reduces each output row over K from that row's values only, in the
same instruction sequence in whichever tile and tile row the row lands; nothing is split over K,
so no partial sums of other programs are ever added. M changes the grid only.

Program order: pids are grouped so that GROUP_M consecutive programs take the GROUP_M m tiles of
one n tile (the "grouped ordering" of Triton's matmul tutorial). At decode sizes (M <= GROUP_M *
BLOCK_M) every m tile of a weight tile runs at about the same time, so the weight tile comes from
DRAM once and from L2 for the others: a step reads each weight about once, where fixed 128-row
slabs of cuBLAS (engine.batch.rows.project_slabs) read it once per slab. The grouping changes
which program computes a tile, never how, so it moves no bits.

Nothing syncs the host; the output comes from torch.empty, so a call can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchd.kernels._backend import interpreting, patch_interpreter_index

if interpreting():
    patch_interpreter_index()


@dataclass(frozen=True)
class RowGemmConfig:
    """Everything that decides a row's bits besides its own values and the weight; fixed per (N, K, dtype)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8       # m tiles of one n tile that run next to each other
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's smallest tile), got {value}")
        if self.group_m < 1 or self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"group_m >= 1, num_warps a power of two <= 16 and num_stages >= 1, got {self}")

    def grid(self, M: int, N: int) -> tuple[int]:
        return (triton.cdiv(M, self.block_m) * triton.cdiv(N, self.block_n),)


# The one config per (N, K, element size). UNMEASURED: Llama-3-8B's projections hold first guesses
# (the heuristic's tiles, 64-row m tiles so that a 64..512-row step has 1..8 m tiles per weight
# tile, one group); choose them on the GPU with `python bench/row_gemm.py --sweep` and paste its
# table here. Changing an entry changes the bits of every row computed with that weight (so
# outputs recorded before differ): the values stay within rounding of the reference.
TUNED: dict[tuple[int, int, int], RowGemmConfig] = {
    # Llama-3-8B, bf16/f16 (same bytes)
    (6144, 4096, 2): RowGemmConfig(64, 128, 64, group_m=8, num_warps=4, num_stages=4),      # qkv
    (4096, 4096, 2): RowGemmConfig(64, 64, 64, group_m=8, num_warps=4, num_stages=4),       # o
    (28672, 4096, 2): RowGemmConfig(64, 128, 64, group_m=8, num_warps=4, num_stages=4),     # gate_up
    (4096, 14336, 2): RowGemmConfig(64, 64, 64, group_m=8, num_warps=4, num_stages=4),      # down
    (128256, 4096, 2): RowGemmConfig(64, 128, 64, group_m=8, num_warps=4, num_stages=4),    # lm_head
}


def heuristic_config(N: int, K: int, dtype: torch.dtype) -> RowGemmConfig:
    """For shapes outside the table, from (N, K, dtype) only (never the device, so two workers with
    the same weights compute the same bits): 64-row m tiles; 64-row weight tiles for N <= 8192, so
    that a small step still has N / 64 programs pulling the weight, 128 above; 128 bytes of K a
    step. Float32 takes IEEE products (no TF32) and fewer stages (twice the bytes a tile)."""
    size = dtype.itemsize
    block_n = 64 if N <= 8192 else 128
    return RowGemmConfig(64, block_n, 128 // size, group_m=8, num_warps=4, num_stages=4 if size <= 2 else 3)


def choose_config(N: int, K: int, dtype: torch.dtype) -> RowGemmConfig:
    """The one config for (N, K, dtype): the table for 2-byte dtypes, else the heuristic."""
    config = TUNED.get((N, K, dtype.itemsize)) if dtype.itemsize == 2 else None
    return config or heuristic_config(N, K, dtype)


def dot_flags(dtype: torch.dtype) -> tuple[bool, str]:
    """(UPCAST_DOT, DOT_PRECISION): IEEE products for float32 (not TF32); under the CPU interpreter
    bf16 tiles go to float32 first (its tl.dot multiplies bf16 tiles as raw integers), which is
    exact: the interpreter's patched dot sums the products in float64 (kernels._backend)."""
    return interpreting() and dtype == torch.bfloat16, "ieee" if dtype == torch.float32 else "tf32"


@triton.jit(do_not_specialize=["M"])
def _row_gemm_kernel(
    X, W, Bias, Out,                     # x [M, K], weight [N, K], bias [N] (or any pointer), out [M, N]
    M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and BLOCK_K >= 16)
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(M, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M m tiles of one n tile, then the next n tile (the last group may be short)
    per_group = GROUP_M * n_tiles
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(m_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = X + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]          # [BLOCK_M, BLOCK_K]
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]          # [BLOCK_N, BLOCK_K]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):      # increasing k, the same steps for every tile and every M
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + offs_k) < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST_DOT:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = Out + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def row_linear_triton(
    x: torch.Tensor,                     # [M, K], stride(1) == 1
    weight: torch.Tensor,                # [N, K], stride(1) == 1
    bias: torch.Tensor | None,           # [N] contiguous or None
    *,
    config: RowGemmConfig | None = None,
) -> torch.Tensor:
    """-> [M, N] in x's dtype. Shapes are validated by the public wrapper; `config` overrides the
    table (tests, bench/row_gemm.py --sweep)."""
    M, K = x.shape
    N = weight.shape[0]
    if config is None:
        config = choose_config(N, K, x.dtype)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    upcast, precision = dot_flags(x.dtype)
    _row_gemm_kernel[config.grid(M, N)](
        x, weight, bias if bias is not None else out, out,
        M, N, K,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=K % config.block_k == 0, UPCAST_DOT=upcast, DOT_PRECISION=precision,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


__all__ = ["RowGemmConfig", "TUNED", "choose_config", "heuristic_config", "row_linear_triton"]
