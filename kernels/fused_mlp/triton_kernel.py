"""The MLP half of a decode layer in two launches: gate/up, silu*mul and down in one kernel, then an
ordered sum of its partials with the residual.

The chain (kernels.small_matmul) runs gate/up, then down (a k split), then down's reduce: three
launches, and down cannot start before the last gate/up program ends, although each of down's k
columns needs only the act values of its own rows. Here program p owns a slice of the intermediate
axis, rows [p * I // P, (p + 1) * I // P) (P = one program per multiprocessor by default, so there
is no second wave): it computes those rows of act = silu(gate) * up, then multiplies them into the
matching rows of down's transposed weight (down_t [I, H], so the slice is contiguous) and writes a
float32 partial [M, H]. Weight bytes stream from one k loop into the next with no kernel boundary
and no wave tail between them. `_mlp_reduce_kernel` sums the P partials of each output column in
one fixed order (a tile of them, tl.sum), rounds, adds the residual and emits the next norm's
inputs, as small_matmul's reduce does.

Batch invariance: the slices depend on (I, P) only, BLOCK_M is 16 whatever M is, and M enters as
a mask; a row goes through the same instructions alone or among 17 (tests check it bit for bit).

Weights before the wait (PRELOAD) and settled inputs (EARLY, the residual) follow kernels._pdl, as
in kernels.small_matmul.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._backend import (early_reads_enabled, interpreting, launch_options, multiprocessor_count,
                              patch_interpreter_index, pdl_enabled, pdl_trigger_point)
from kernels._pdl import pdl_trigger, pdl_wait
from kernels._trace import END, START, WAITED, trace_args, trace_mark
from kernels.small_matmul.triton_kernel import BLOCK_M, dot_flags, reduce_epilogue_inputs, store_reduced_row

if interpreting():
    patch_interpreter_index()


@dataclass(frozen=True)
class FusedMlpConfig:
    programs: int = 0        # slices of the intermediate axis; 0: one per multiprocessor
    block_k: int = 64        # gate/up columns per k step
    block_n: int = 64        # down's output columns per step
    num_warps: int = 4
    num_stages: int = 3
    preload: int = 0         # gate/up k steps requested before griddepcontrol.wait (0..2)
    reduce_block: int = 32   # output columns per reduce program
    down_swap: bool = True   # down as (down_t tile)^T act (the tile the MMA's A operand); False: act^T tile
    prefetch_down: int = 0   # ask the L2 for the slice's down rows: 0 no, 1 before the wait, 2 after it

    def __post_init__(self):
        if not 0 <= self.preload <= 2:
            raise ValueError(f"preload is 0..2 k steps, got {self.preload}")

    def slices(self, intermediate: int, device: torch.device) -> int:
        """P, the number of slices (and programs per 16 rows): never more than I / 8 rows' worth."""
        programs = self.programs or multiprocessor_count(device)
        return max(1, min(programs, intermediate // 8))


# The MLP shapes where this kernel beat the chain of small_matmul launches in whole decode steps on
# the H200 (`bench/step_sweep.py` mlp= variants against BATCHD_FUSED_MLP=0, kernels/small_matmul/
# NOTES.md "Stop 19"); with BATCHD_FUSED_MLP unset the engine takes the kernel for these only.
# Qwen2.5-1.5B (best 816 against 837 tok/s), Llama-3-8B (236 against 246) and SmolLM2-135M (1626
# against 1755) keep the chain. Key: (I, H, element size).
TUNED: dict[tuple[int, int, int], FusedMlpConfig] = {
    (4864, 896, 2): FusedMlpConfig(76, 64, 64, num_warps=4, num_stages=7),  # Qwen2.5-0.5B: 1581 against 1341
}


def choose_mlp_config(intermediate: int, hidden: int, dtype: torch.dtype) -> FusedMlpConfig:
    config = TUNED.get((intermediate, hidden, dtype.itemsize))
    if config is not None:
        return config
    block = 64 if dtype.itemsize <= 2 else 32    # float32 tiles twice the bytes
    while hidden % block:                         # H a multiple of 16 (kernels.fused_mlp.mlp_fits)
        block //= 2
    # 5 stages: 3 measured 20% slower at Qwen2.5-1.5B (the loops are short of bytes in flight);
    # shared memory stays under 228 KB for slices up to 128 rows at 64-column steps
    return FusedMlpConfig(block_k=block, block_n=block, num_stages=5 if dtype.itemsize <= 2 else 3)


def measured_faster(intermediate: int, hidden: int, dtype: torch.dtype) -> bool:
    """Whether the table holds this MLP shape: the kernel beat the chain there."""
    return (intermediate, hidden, dtype.itemsize) in TUNED


def rows_per_slice(intermediate: int, programs: int) -> int:
    """BLOCK_T: the power of 2 (>= 16, the MMA's narrowest side) that holds the largest slice."""
    return max(16, triton.next_power_of_2(triton.cdiv(intermediate, programs)))


@triton.jit
def _gate_up_tiles(g_ptrs, k0, t_ok, IH):
    """The [BLOCK_T, BLOCK_K] gate and up tiles of the slice at column k0 (streamed once)."""
    wg = tl.load(g_ptrs + k0, mask=t_ok[:, None], other=0.0, eviction_policy="evict_first")
    wu = tl.load(g_ptrs + IH + k0, mask=t_ok[:, None], other=0.0, eviction_policy="evict_first")
    return wg, wu


@triton.jit
def _gate_up_step(acc_g, acc_u, wg, wu, x_ptrs, k0, m_ok, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    x = tl.load(x_ptrs + k0, mask=m_ok[:, None], other=0.0)                 # [BLOCK_M, BLOCK_K]
    if UPCAST_DOT:
        x = x.to(tl.float32)
        wg = wg.to(tl.float32)
        wu = wu.to(tl.float32)
    acc_g = tl.dot(wg, tl.trans(x), acc_g, input_precision=DOT_PRECISION)   # [BLOCK_T, BLOCK_M]
    acc_u = tl.dot(wu, tl.trans(x), acc_u, input_precision=DOT_PRECISION)
    return acc_g, acc_u


@triton.jit
def _prefetch_rows_to_l2(W, rows, ok, H):
    """Ask the L2 for whole rows of the [*, H] weight W (one bulk prefetch per row; the program's
    down rows are contiguous, so they stream from HBM while the gate/up loop runs)."""
    row_bytes = H * W.dtype.element_ty.primitive_bitwidth // 8
    size = tl.where(ok, row_bytes, 0).to(tl.int32)
    addr = W + rows.to(tl.int64) * H
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["M", "trace_row"])
def _fused_mlp_kernel(
    X, SumSqIn, GU, DT, Part,
    # X [M, H] norm_weight * h; SumSqIn [parts_in, M] f32; GU [2I, H] gate rows then up rows;
    # DT [I, H] down's weight transposed; Part [P, M, H] f32
    M, H, I, eps, parts_in, programs, stride_xm,
    PARTS_P2: tl.constexpr, USE_PDL: tl.constexpr, TRIGGER: tl.constexpr, PRELOAD: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, DOWN_SWAP: tl.constexpr, PREFETCH_DOWN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    Trace, trace_row, TRACE: tl.constexpr,       # kernels._trace
):
    """Program (m block, slice p): act rows of the slice, then their product with down_t's rows ->
    Part[p]. H is a multiple of BLOCK_K and BLOCK_N (the host checks)."""
    tl.static_assert(PRELOAD <= 2)
    pid_m = tl.program_id(0)
    p = tl.program_id(1)
    r0 = p * I // programs
    r1 = (p + 1) * I // programs
    rows = r0 + tl.arange(0, BLOCK_T)
    t_ok = rows < r1
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_N)
    IH = I.to(tl.int64) * H
    g_ptrs = GU + rows[:, None].to(tl.int64) * H + offs_k[None, :]

    trace_mark(Trace, trace_row, START, TRACE)
    pdl_trigger(USE_PDL, TRIGGER, 0)
    if PREFETCH_DOWN == 1:
        _prefetch_rows_to_l2(DT, rows, t_ok, H)
    # weights depend on no kernel: the first PRELOAD tiles are requested before the wait
    if PRELOAD >= 1:
        wg0, wu0 = _gate_up_tiles(g_ptrs, 0, t_ok, IH)
    if PRELOAD >= 2:
        wg1, wu1 = _gate_up_tiles(g_ptrs, BLOCK_K, t_ok, IH)
    pdl_wait(USE_PDL, TRIGGER)                   # X, SumSqIn: from the previous kernel
    trace_mark(Trace, trace_row, WAITED, TRACE)
    if PREFETCH_DOWN == 2:
        _prefetch_rows_to_l2(DT, rows, t_ok, H)

    parts = tl.arange(0, PARTS_P2)
    sumsq = tl.load(SumSqIn + parts[:, None] * M + offs_m[None, :],
                    mask=(parts < parts_in)[:, None] & m_ok[None, :], other=0.0)
    row_scale = tl.rsqrt(tl.sum(sumsq, 0) / H + eps)                  # [BLOCK_M]
    x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc_g = tl.zeros([BLOCK_T, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_T, BLOCK_M], dtype=tl.float32)
    # k steps in increasing order whether preloaded or not: the same sums
    if PRELOAD >= 1:
        acc_g, acc_u = _gate_up_step(acc_g, acc_u, wg0, wu0, x_ptrs, 0, m_ok, UPCAST_DOT, DOT_PRECISION)
    if PRELOAD >= 2:
        acc_g, acc_u = _gate_up_step(acc_g, acc_u, wg1, wu1, x_ptrs, BLOCK_K, m_ok, UPCAST_DOT, DOT_PRECISION)
    for k0 in range(PRELOAD * BLOCK_K, H, BLOCK_K):
        wg, wu = _gate_up_tiles(g_ptrs, k0, t_ok, IH)
        acc_g, acc_u = _gate_up_step(acc_g, acc_u, wg, wu, x_ptrs, k0, m_ok, UPCAST_DOT, DOT_PRECISION)
    pdl_trigger(USE_PDL, TRIGGER, 2)

    # silu(gate) * up with the eager rounding (kernels.small_matmul's gated epilogue): gate, up and
    # silu(gate) each in the model dtype. Rows past the slice and columns past M are 0.
    dtype = X.dtype.element_ty
    g = (acc_g * row_scale[None, :]).to(dtype).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    act = (silu * (acc_u * row_scale[None, :]).to(dtype).to(tl.float32)).to(dtype)    # [BLOCK_T, BLOCK_M]
    if UPCAST_DOT:
        act = act.to(tl.float32)

    d_ptrs = DT + rows[:, None].to(tl.int64) * H + offs_n[None, :]
    if DOWN_SWAP:
        part_ptrs = Part + (p * M + offs_m[None, :]).to(tl.int64) * H + offs_n[:, None]
    else:
        act_rows = tl.trans(act)                                                              # [BLOCK_M, BLOCK_T]
        part_ptrs = Part + (p * M + offs_m[:, None]).to(tl.int64) * H + offs_n[None, :]
    for n0 in range(0, H, BLOCK_N):
        wd = tl.load(d_ptrs + n0, mask=t_ok[:, None], other=0.0, eviction_policy="evict_first")   # [BLOCK_T, BLOCK_N]
        if UPCAST_DOT:
            wd = wd.to(tl.float32)
        if DOWN_SWAP:
            part = tl.dot(tl.trans(wd), act, input_precision=DOT_PRECISION)                   # [BLOCK_N, BLOCK_M]
            tl.store(part_ptrs + n0, part, mask=m_ok[None, :])
        else:
            part = tl.dot(act_rows, wd, input_precision=DOT_PRECISION)                        # [BLOCK_M, BLOCK_N]
            tl.store(part_ptrs + n0, part, mask=m_ok[:, None])
    trace_mark(Trace, trace_row, END, TRACE)


@triton.jit(do_not_specialize=["M", "trace_row"])
def _mlp_reduce_kernel(
    Part, Res, Out, NextNormW, WeightedOut, SumSqOut,
    # Part [P, M, H] f32; Res, Out, WeightedOut [M, H]; NextNormW [H]; SumSqOut [cdiv(H, BLOCK), M] f32
    M, H, programs, stride_rm, stride_om,
    P_P2: tl.constexpr, EMIT_NORM: tl.constexpr, USE_PDL: tl.constexpr, TRIGGER: tl.constexpr,
    EARLY: tl.constexpr, BLOCK: tl.constexpr,
    Trace, trace_row, TRACE: tl.constexpr,       # kernels._trace
):
    """Out[row, cols] = residual + (the P partials summed in one fixed order), rounded first.
    EARLY: the residual (settled, kernels._pdl) and the next norm's weight are read before the wait."""
    trace_mark(Trace, trace_row, START, TRACE)
    pdl_trigger(USE_PDL, TRIGGER, 0)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    if EARLY:
        _, res, next_nw = reduce_epilogue_inputs(Part, Res, NextNormW, row, offs, ok, stride_rm, False, True, EMIT_NORM)
    pdl_wait(USE_PDL, TRIGGER)
    trace_mark(Trace, trace_row, WAITED, TRACE)
    slices = tl.arange(0, P_P2)
    parts = tl.load(Part + (slices[:, None] * M + row).to(tl.int64) * H + offs[None, :],
                    mask=(slices < programs)[:, None] & ok[None, :], other=0.0)      # [P_P2, BLOCK], all in flight
    acc = tl.sum(parts, 0)                  # one tree order, fixed by the constexprs: the same for any M
    pdl_trigger(USE_PDL, TRIGGER, 2)
    if not EARLY:
        _, res, next_nw = reduce_epilogue_inputs(Part, Res, NextNormW, row, offs, ok, stride_rm, False, True,
                                                 EMIT_NORM)
    dtype = Out.dtype.element_ty
    y = (acc.to(dtype).to(tl.float32) + res.to(tl.float32)).to(dtype)
    store_reduced_row(y, Out, row, offs, ok, stride_om, M, next_nw, WeightedOut, SumSqOut, EMIT_NORM)
    trace_mark(Trace, trace_row, END, TRACE)


def fused_mlp_triton(
    x: torch.Tensor,                 # [M, H] norm_weight * h
    row_sumsq: torch.Tensor,         # [parts, M] f32
    gate_up: torch.Tensor,           # [2I, H] contiguous
    down_t: torch.Tensor,            # [I, H] contiguous
    residual: torch.Tensor,          # [M, H], stride(1) == 1
    *,
    eps: float,
    emit_norm_weight: torch.Tensor | None = None,   # [H]
    settled: bool = False,           # residual written two or more launches back
    config: FusedMlpConfig | None = None,
):
    """Shapes are validated by the public wrapper. -> out [M, H], or (out, NormInputs)."""
    from kernels.small_matmul.reference import NormInputs

    M, H = x.shape
    I = down_t.shape[0]
    if config is None:
        config = choose_mlp_config(I, H, x.dtype)
    if H % config.block_k or H % config.block_n or config.preload * config.block_k > H:
        raise ValueError(f"the fused MLP needs H ({H}) a multiple of block_k and block_n (config {config})")
    programs = config.slices(I, x.device)
    block_t = rows_per_slice(I, programs)
    upcast, precision = dot_flags(x.dtype)
    pdl = pdl_enabled(x.device)
    part = torch.empty(programs, M, H, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, BLOCK_M), programs)
    _fused_mlp_kernel[grid](
        x, row_sumsq, gate_up, down_t, part,
        M, H, I, eps, row_sumsq.shape[0], programs, x.stride(0),
        PARTS_P2=triton.next_power_of_2(row_sumsq.shape[0]), USE_PDL=pdl, TRIGGER=pdl_trigger_point("linear"),
        PRELOAD=config.preload, UPCAST_DOT=upcast, DOT_PRECISION=precision, DOWN_SWAP=config.down_swap,
        PREFETCH_DOWN=0 if interpreting() else config.prefetch_down,
        BLOCK_M=BLOCK_M, BLOCK_T=block_t, BLOCK_K=config.block_k, BLOCK_N=config.block_n,
        **trace_args(f"mlp {I}x{H} in {programs} slices", grid, part),
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(pdl),
    )
    out = torch.empty(M, H, dtype=x.dtype, device=x.device)
    emit = emit_norm_weight is not None
    block = config.reduce_block
    if emit:
        weighted = torch.empty_like(out)
        sumsq_out = torch.empty(triton.cdiv(H, block), M, dtype=torch.float32, device=x.device)
    else:
        weighted, sumsq_out = out, part
    reduce_grid = (M, triton.cdiv(H, block))
    _mlp_reduce_kernel[reduce_grid](
        part, residual, out, emit_norm_weight if emit else out, weighted, sumsq_out,
        M, H, programs, residual.stride(0), out.stride(0),
        P_P2=triton.next_power_of_2(programs), EMIT_NORM=emit, USE_PDL=pdl, TRIGGER=pdl_trigger_point("reduce"),
        EARLY=settled and early_reads_enabled(), BLOCK=block,
        **trace_args(f"mlp reduce {H} of {programs} slices", reduce_grid, out), num_warps=4, **launch_options(pdl),
    )
    return (out, NormInputs(weighted, sumsq_out)) if emit else out


__all__ = ["FusedMlpConfig", "TUNED", "choose_mlp_config", "fused_mlp_triton", "measured_faster", "rows_per_slice"]
