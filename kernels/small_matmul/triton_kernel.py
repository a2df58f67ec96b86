"""Batch-invariant small-M linear in Triton: fixed row tiles, split-K at shape-only boundaries.

Program (m block, n block, k split) multiplies a BLOCK_M x [k range] tile of x by a BLOCK_N x
[k range] tile of the weight with tl.dot, float32 accumulation, walking its k range in BLOCK_K steps
in increasing order. BLOCK_M is always 16 whatever M is (rows past M are masked to zero), so a row
goes through the same instructions whether it is alone or one of 17, in any position of its tile;
M enters only as a mask bound and as the number of m blocks (M = 17..32 runs a second m block, the
same code). The k splits are cut at multiples of BLOCK_K that depend on (N, K) only; with more than
one split the float32 partials go to a [splits, M, N] buffer and a second kernel sums them in split
order 0, 1, 2, ... (no atomics), adds the bias and casts. One config per (N, K, dtype): a table
measured on an H200 (bench/small_matmul.py --tune), a heuristic elsewhere; never autotuned per call.

SWAP computes out^T = W x^T (the weight as the MMA's A operand, BLOCK_N its M side), which lets
Hopper use wgmma with the 16 rows of x as its narrow N side; SWAP=False computes x W^T.

Nothing syncs the host; outputs come from torch.empty, so a call can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._backend import interpreting, multiprocessor_count, patch_interpreter_index

BLOCK_M = 16
REDUCE_BLOCK = 1024

if interpreting():
    patch_interpreter_index()


@dataclass(frozen=True)
class SmallLinearConfig:
    block_n: int
    block_k: int
    splits: int            # requested k splits; the effective count is effective_splits(K)
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = True

    def k_per_split(self, K: int) -> int:
        """Columns of K per split, a multiple of block_k (depends on K only)."""
        k_blocks = triton.cdiv(K, self.block_k)
        return triton.cdiv(k_blocks, max(1, min(self.splits, k_blocks))) * self.block_k

    def effective_splits(self, K: int) -> int:
        return triton.cdiv(K, self.k_per_split(K))


# Measured on one H200 (132 SMs, copy bandwidth 4.27 TB/s) by `python bench/small_matmul.py --tune`,
# bf16 at M = 1, weights streamed from HBM; f16 uses the bf16 entry (same bytes). Narrow 16-row weight
# tiles win for the small projections (more programs without a k split and its reduce launch).
# Key: (N, K, element size in bytes).
TUNED: dict[tuple[int, int, int], SmallLinearConfig] = {
    # Qwen2.5-1.5B
    (2048, 1536, 2): SmallLinearConfig(16, 256, 1, num_warps=4, num_stages=4, swap=True),      # qkv
    (1536, 1536, 2): SmallLinearConfig(16, 256, 1, num_warps=4, num_stages=4, swap=True),      # o
    (17920, 1536, 2): SmallLinearConfig(64, 128, 1, num_warps=4, num_stages=3, swap=True),     # gate_up
    (1536, 8960, 2): SmallLinearConfig(64, 128, 11, num_warps=4, num_stages=3, swap=True),     # down
    (151936, 1536, 2): SmallLinearConfig(64, 128, 1, num_warps=4, num_stages=3, swap=True),    # lm_head
    # Llama-3-8B
    (6144, 4096, 2): SmallLinearConfig(64, 128, 1, num_warps=4, num_stages=4, swap=True),      # qkv
    (4096, 4096, 2): SmallLinearConfig(32, 256, 1, num_warps=4, num_stages=4, swap=True),      # o
    (28672, 4096, 2): SmallLinearConfig(64, 128, 1, num_warps=4, num_stages=4, swap=True),     # gate_up
    (4096, 14336, 2): SmallLinearConfig(64, 128, 3, num_warps=4, num_stages=4, swap=True),     # down
    (128256, 4096, 2): SmallLinearConfig(64, 128, 1, num_warps=4, num_stages=4, swap=True),    # lm_head
}


def heuristic_config(N: int, K: int, dtype: torch.dtype, sms: int) -> SmallLinearConfig:
    """For shapes outside the table, following what the table's measurements showed: weights up to
    16 MiB in 16-row tiles with no split; larger ones in 64-row tiles, split over K only when there
    are fewer 64-row blocks than multiprocessors (to about two programs per multiprocessor)."""
    size = dtype.itemsize
    if N * K * size <= (16 << 20):
        return SmallLinearConfig(16, 512 // size, 1, num_warps=4, num_stages=4, swap=True)
    block_k = 256 // size
    n_blocks = triton.cdiv(N, 64)
    k_blocks = triton.cdiv(K, block_k)
    splits = 1 if n_blocks >= sms else max(1, min(k_blocks, triton.cdiv(2 * sms, n_blocks)))
    return SmallLinearConfig(64, block_k, splits, num_warps=4, num_stages=4 if size <= 2 else 3, swap=True)


def choose_config(N: int, K: int, dtype: torch.dtype, device: torch.device) -> SmallLinearConfig:
    """The one config for (N, K, dtype) on `device`: the tuned table on CUDA, else the heuristic."""
    if device.type == "cuda" and dtype.itemsize == 2:
        tuned = TUNED.get((N, K, 2))
        if tuned is not None:
            return tuned
    return heuristic_config(N, K, dtype, multiprocessor_count(device))


@triton.jit(do_not_specialize=["M"])
def _small_linear_kernel(
    X, W, Bias, Out, Part,     # X [M, K]; W [N, K]; Bias [N]; Out [M, N]; Part [SPLITS, M, N] f32
    M, N, K,
    stride_xm, stride_wn, stride_om,
    k_per_split,               # multiple of BLOCK_K
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, SWAP: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tl.static_assert(BLOCK_M >= 16)
    tl.static_assert(BLOCK_K % 16 == 0)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)

    x_ptrs = X + offs_m[:, None] * stride_xm + tl.arange(0, BLOCK_K)[None, :]
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + tl.arange(0, BLOCK_K)[None, :]
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs + k0, mask=m_ok[:, None], other=0.0)
            if EVEN_N:
                w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
            else:
                w = tl.load(w_ptrs + k0, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
        else:
            k_ok = (k0 + tl.arange(0, BLOCK_K)) < K
            x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
        if UPCAST_DOT:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)       # [BLOCK_N, BLOCK_M]
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)       # [BLOCK_M, BLOCK_N]

    if SWAP:
        mask = n_ok[:, None] & m_ok[None, :]
        if SPLIT:
            ptrs = Part + (pid_s * M + offs_m[None, :]) * N + offs_n[:, None]
            tl.store(ptrs, acc, mask=mask)
        else:
            if HAS_BIAS:
                acc += tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            ptrs = Out + offs_m[None, :] * stride_om + offs_n[:, None]
            tl.store(ptrs, acc.to(Out.dtype.element_ty), mask=mask)
    else:
        mask = m_ok[:, None] & n_ok[None, :]
        if SPLIT:
            ptrs = Part + (pid_s * M + offs_m[:, None]) * N + offs_n[None, :]
            tl.store(ptrs, acc, mask=mask)
        else:
            if HAS_BIAS:
                acc += tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            ptrs = Out + offs_m[:, None] * stride_om + offs_n[None, :]
            tl.store(ptrs, acc.to(Out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _reduce_splits_kernel(
    Part, Bias, Out,           # Part [SPLITS, M, N] f32; Bias [N]; Out [M, N]
    M, N, stride_om, splits,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.load(Part + row * N + offs, mask=ok, other=0.0)
    for s in range(1, splits):                       # fixed order: split 0, 1, 2, ...
        acc += tl.load(Part + (s * M + row) * N + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(Bias + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_om + offs, acc.to(Out.dtype.element_ty), mask=ok)


def dot_flags(dtype: torch.dtype) -> tuple[bool, str]:
    """(UPCAST_DOT, DOT_PRECISION): IEEE products for float32 (not TF32); under the CPU interpreter
    bf16 tiles go to float32 first (triton 3.6's interpreter multiplies bf16 tiles as raw integers)."""
    precision = "ieee" if dtype == torch.float32 else "tf32"
    return interpreting() and dtype == torch.bfloat16, precision


def small_linear_triton(
    x: torch.Tensor,                     # [M, K], M = 1..32, stride(1) == 1
    weight: torch.Tensor,                # [N, K], stride(1) == 1
    bias: torch.Tensor | None,           # [N] contiguous or None
    *,
    config: SmallLinearConfig | None = None,
) -> torch.Tensor:
    """Shapes are validated by the public wrapper; `config` overrides the table (tests, bench --tune)."""
    M, K = x.shape
    N = weight.shape[0]
    if config is None:
        config = choose_config(N, K, x.dtype, x.device)
    k_per_split = config.k_per_split(K)
    splits = triton.cdiv(K, k_per_split)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    part = torch.empty(splits, M, N, dtype=torch.float32, device=x.device) if splits > 1 else out
    upcast, precision = dot_flags(x.dtype)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, config.block_n), splits)
    bias_arg = bias if bias is not None else out
    _small_linear_kernel[grid](
        x, weight, bias_arg, out, part,
        M, N, K,
        x.stride(0), weight.stride(0), out.stride(0),
        k_per_split,
        HAS_BIAS=bias is not None, SPLIT=splits > 1, SWAP=config.swap,
        EVEN_N=N % config.block_n == 0, EVEN_K=K % config.block_k == 0,
        UPCAST_DOT=upcast, DOT_PRECISION=precision,
        BLOCK_M=BLOCK_M, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if splits > 1:
        _reduce_splits_kernel[(M, triton.cdiv(N, REDUCE_BLOCK))](
            part, bias_arg, out,
            M, N, out.stride(0), splits,
            HAS_BIAS=bias is not None, BLOCK=REDUCE_BLOCK,
            num_warps=4,
        )
    return out


__all__ = [
    "small_linear_triton",
    "SmallLinearConfig",
    "choose_config",
    "heuristic_config",
    "TUNED",
    "BLOCK_M",
]
