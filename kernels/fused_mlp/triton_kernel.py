"""The MLP half of a decode layer in two launches: gate/up, silu*mul and down in one kernel, then an
ordered sum of its partials with the residual.

The chain (kernels.small_matmul) runs gate/up, then down (a k split), then down's reduce: three
launches, and down cannot start before the last gate/up program ends, although each of down's k
columns needs only the act values of its own rows. Here program p owns a slice of the intermediate
axis, rows [p * I // P, (p + 1) * I // P): it computes those rows of act = silu(gate) * up, then
multiplies them into the matching rows of down's transposed weight (down_t [I, H], so the slice is
contiguous) and writes a float32 partial [M, H]. `_mlp_reduce_kernel` sums the P partials of each
output column in one fixed order (a tile of them, tl.sum), rounds, adds the residual and emits the
next norm's inputs, as small_matmul's reduce does.

A slice is held in a main tile of BLOCK_T rows, a power of 2 no larger than the smallest slice, so
it is always full, plus a remainder tile of BLOCK_R rows (masked; 0: none). Qwen2.5-1.5B's 8960 rows
in 132 slices of 67-68 are 64 + 16 rows rather than 128 (half of whose shared memory would stay
empty and cap the pipeline's stages). The remainder's products are added after the main tile's.

Batch invariance: the slices depend on (I, P) only, BLOCK_M is 16 whatever M is, and M enters as
a mask; a row goes through the same instructions alone or among 17 (tests check it bit for bit).
Settled inputs (EARLY, the residual) follow kernels._pdl, as in kernels.small_matmul. Weights
requested before the wait, an L2 prefetch of down's slice and act^T as the MMA's A operand were
measured slower and dropped (commit 410a005 has them; docs/performance.md "Stop 19").
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchd.kernels._backend import (early_reads_enabled, interpreting, launch_options, multiprocessor_count,
                              patch_interpreter_index, pdl_enabled, pdl_trigger_point)
from batchd.kernels._pdl import pdl_trigger, pdl_wait
from batchd.kernels._trace import END, START, WAITED, trace_args, trace_mark
from batchd.kernels.small_matmul.triton_kernel import (BLOCK_M, dot_flags, reduce_epilogue_inputs, silu_mul_rounded,
                                               store_reduced_row)

if interpreting():
    patch_interpreter_index()


@dataclass(frozen=True)
class FusedMlpConfig:
    programs: int = 0        # slices of the intermediate axis; 0: one per multiprocessor (stream: CTAs, at most that)
    block_k: int = 64        # gate/up columns per k step
    block_n: int = 64        # down's output columns per step
    num_warps: int = 4
    num_stages: int = 5
    reduce_block: int = 32   # output columns per reduce program
    remainder: bool = True   # a slice as a full tile + a remainder tile; False: one padded power-of-2 tile
    stream: bool = False     # the slices on stream_mlp.cu (bulk-copy weight ring, one CTA per SM) instead
    ring_kb: int = 128       # its ring of shared-memory slots (stream only)

    def slices(self, intermediate: int, device: torch.device) -> int:
        """P, the number of slices (and programs per 16 rows): never more than I / 8 rows' worth."""
        programs = self.programs or multiprocessor_count(device)
        return max(1, min(programs, intermediate // 8))

    def tiles(self, intermediate: int, programs: int) -> tuple[int, int]:
        """(BLOCK_T, BLOCK_R): the main tile, full for every slice (at least 16 rows, the MMA's
        narrowest side, masked only where slices are shorter), and the remainder tile (0: none)."""
        shortest, longest = intermediate // programs, triton.cdiv(intermediate, programs)
        if not self.remainder or shortest < 16:
            return max(16, triton.next_power_of_2(longest)), 0
        main = 1 << (shortest.bit_length() - 1)          # the largest power of 2 <= shortest
        rest = longest - main
        return main, 0 if rest <= 0 else max(16, triton.next_power_of_2(rest))


# The MLP shapes where this kernel beat the chain of small_matmul launches in whole decode steps on
# the H200 (`bench/step_sweep.py` mlp= variants against BATCHD_FUSED_MLP=0, kernels/small_matmul/
# docs/performance.md "Stop 19"); with BATCHD_FUSED_MLP unset the engine takes the kernel for these only.
# Qwen2.5-1.5B (best 816 against 837 tok/s), Llama-3-8B (236 against 246) and SmolLM2-135M (1626
# against 1755) keep the chain. Key: (I, H, element size).
TUNED: dict[tuple[int, int, int], FusedMlpConfig] = {
    (4864, 896, 2): FusedMlpConfig(76, 64, 64, num_warps=4, num_stages=7),  # Qwen2.5-0.5B: 1581 against 1341
}


def choose_mlp_config(intermediate: int, hidden: int, dtype: torch.dtype, device: torch.device) -> FusedMlpConfig:
    """The table's config, else 64-column steps (32 in float32) and as many pipeline stages as fit
    192 KB of shared memory, at most 7: the loops run short of bytes in flight (Qwen2.5-1.5B: 3
    stages 664 tok/s, 5 stages 741-816, 7 stages 820; Qwen2.5-0.5B: 5 stages 1559, 7 stages 1581)."""
    config = TUNED.get((intermediate, hidden, dtype.itemsize))
    if config is not None:
        return config
    block = 64 if dtype.itemsize <= 2 else 32    # float32 tiles twice the bytes
    while hidden % block:                         # H a multiple of 16 (kernels.fused_mlp.mlp_fits)
        block //= 2
    config = FusedMlpConfig(block_k=block, block_n=block)
    programs = config.slices(intermediate, device)
    stage_bytes = 2 * sum(config.tiles(intermediate, programs)) * block * dtype.itemsize   # gate + up tiles
    return dataclasses.replace(config, num_stages=max(2, min(7, (192 << 10) // stage_bytes)))


def measured_faster(intermediate: int, hidden: int, dtype: torch.dtype) -> bool:
    """Whether the table holds this MLP shape: the kernel beat the chain there."""
    return (intermediate, hidden, dtype.itemsize) in TUNED


@triton.jit
def _gate_up_tiles(g_ptrs, k0, ok, IH):
    """The [rows, BLOCK_K] gate and up tiles of the slice at column k0 (streamed once)."""
    wg = tl.load(g_ptrs + k0, mask=ok[:, None], other=0.0, eviction_policy="evict_first")
    wu = tl.load(g_ptrs + IH + k0, mask=ok[:, None], other=0.0, eviction_policy="evict_first")
    return wg, wu


@triton.jit
def _gate_up_dots(acc_g, acc_u, wg, wu, x, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc += the gate and up tiles [rows, BLOCK_K] times x^T ([BLOCK_M, BLOCK_K] tile of x)."""
    if UPCAST_DOT:
        wg = wg.to(tl.float32)
        wu = wu.to(tl.float32)
    acc_g = tl.dot(wg, tl.trans(x), acc_g, input_precision=DOT_PRECISION)   # [rows, BLOCK_M]
    acc_u = tl.dot(wu, tl.trans(x), acc_u, input_precision=DOT_PRECISION)
    return acc_g, acc_u


@triton.jit
def _silu_mul(acc_g, acc_u, row_scale, dtype: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """silu(gate) * up [rows, BLOCK_M] of the sums scaled by the folded norm's row scale, rounded as
    kernels.small_matmul's gated epilogue rounds (its own code). Rows past the slice give 0."""
    act = silu_mul_rounded(acc_g * row_scale[None, :], acc_u * row_scale[None, :], dtype)
    if UPCAST_DOT:
        act = act.to(tl.float32)
    return act


@triton.jit
def _down_dot(acc, d_ptrs, n0, ok, act, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] += down_t's [rows, BLOCK_N] tile at column n0, transposed, times act."""
    wd = tl.load(d_ptrs + n0, mask=ok[:, None], other=0.0, eviction_policy="evict_first")
    if UPCAST_DOT:
        wd = wd.to(tl.float32)
    return tl.dot(tl.trans(wd), act, acc, input_precision=DOT_PRECISION)


@triton.jit(do_not_specialize=["M", "trace_row"])
def _fused_mlp_kernel(
    X, SumSqIn, GU, DT, Part,
    # X [M, H] norm_weight * h; SumSqIn [parts_in, M] f32; GU [2I, H] gate rows then up rows;
    # DT [I, H] down's weight transposed; Part [P, M, H] f32
    M, H, I, eps, parts_in, programs, stride_xm,
    PARTS_P2: tl.constexpr, USE_PDL: tl.constexpr, TRIGGER: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    Trace, trace_row, TRACE: tl.constexpr,       # kernels._trace
):
    """Program (m block, slice p): act rows of the slice (main tile, then remainder), then their
    product with down_t's rows -> Part[p]. H is a multiple of BLOCK_K and BLOCK_N (the host checks)."""
    REM: tl.constexpr = BLOCK_R > 0
    R_ROWS: tl.constexpr = BLOCK_R if BLOCK_R > 0 else 16     # the remainder's shape where it is unused
    pid_m = tl.program_id(0)
    p = tl.program_id(1)
    r0 = p * I // programs
    r1 = (p + 1) * I // programs
    rows = r0 + tl.arange(0, BLOCK_T)
    t_ok = rows < r1
    rest = r0 + BLOCK_T + tl.arange(0, R_ROWS)
    r_ok = rest < r1
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_N)
    IH = I.to(tl.int64) * H
    g_ptrs = GU + rows[:, None].to(tl.int64) * H + offs_k[None, :]
    gr_ptrs = GU + rest[:, None].to(tl.int64) * H + offs_k[None, :]

    trace_mark(Trace, trace_row, START, TRACE)
    pdl_trigger(USE_PDL, TRIGGER, 0)
    pdl_wait(USE_PDL, TRIGGER)                   # X, SumSqIn: from the previous kernel
    trace_mark(Trace, trace_row, WAITED, TRACE)

    parts = tl.arange(0, PARTS_P2)
    sumsq = tl.load(SumSqIn + parts[:, None] * M + offs_m[None, :],
                    mask=(parts < parts_in)[:, None] & m_ok[None, :], other=0.0)
    row_scale = tl.rsqrt(tl.sum(sumsq, 0) / H + eps)                  # [BLOCK_M]
    x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc_g = tl.zeros([BLOCK_T, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_T, BLOCK_M], dtype=tl.float32)
    rem_g = tl.zeros([R_ROWS, BLOCK_M], dtype=tl.float32)
    rem_u = tl.zeros([R_ROWS, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        wg, wu = _gate_up_tiles(g_ptrs, k0, t_ok, IH)
        if REM:
            rg, ru = _gate_up_tiles(gr_ptrs, k0, r_ok, IH)
        x = tl.load(x_ptrs + k0, mask=m_ok[:, None], other=0.0)     # [BLOCK_M, BLOCK_K]
        if UPCAST_DOT:
            x = x.to(tl.float32)
        acc_g, acc_u = _gate_up_dots(acc_g, acc_u, wg, wu, x, UPCAST_DOT, DOT_PRECISION)
        if REM:
            rem_g, rem_u = _gate_up_dots(rem_g, rem_u, rg, ru, x, UPCAST_DOT, DOT_PRECISION)
    pdl_trigger(USE_PDL, TRIGGER, 2)

    dtype = X.dtype.element_ty
    act = _silu_mul(acc_g, acc_u, row_scale, dtype, UPCAST_DOT)                      # [BLOCK_T, BLOCK_M]
    act_rem = _silu_mul(rem_g, rem_u, row_scale, dtype, UPCAST_DOT)                  # [R_ROWS, BLOCK_M]
    d_ptrs = DT + rows[:, None].to(tl.int64) * H + offs_n[None, :]
    dr_ptrs = DT + rest[:, None].to(tl.int64) * H + offs_n[None, :]
    part_ptrs = Part + (p * M + offs_m[None, :]).to(tl.int64) * H + offs_n[:, None]
    for n0 in range(0, H, BLOCK_N):
        part = _down_dot(tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), d_ptrs, n0, t_ok, act, UPCAST_DOT,
                         DOT_PRECISION)
        if REM:   # the remainder's products after the main tile's: one order
            part = _down_dot(part, dr_ptrs, n0, r_ok, act_rem, UPCAST_DOT, DOT_PRECISION)
        tl.store(part_ptrs + n0, part, mask=m_ok[None, :])                          # [BLOCK_N, BLOCK_M]
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


def _triton_partials(x, row_sumsq, gate_up, down_t, eps: float, config: FusedMlpConfig, pdl: bool) -> torch.Tensor:
    """_fused_mlp_kernel's partials [P, M, H] f32, P slices of the intermediate axis."""
    M, H = x.shape
    I = down_t.shape[0]
    if H % config.block_k or H % config.block_n:
        raise ValueError(f"the fused MLP needs H ({H}) a multiple of block_k and block_n (config {config})")
    programs = config.slices(I, x.device)
    block_t, block_r = config.tiles(I, programs)
    upcast, precision = dot_flags(x.dtype)
    part = torch.empty(programs, M, H, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, BLOCK_M), programs)
    _fused_mlp_kernel[grid](
        x, row_sumsq, gate_up, down_t, part,
        M, H, I, eps, row_sumsq.shape[0], programs, x.stride(0),
        PARTS_P2=triton.next_power_of_2(row_sumsq.shape[0]), USE_PDL=pdl, TRIGGER=pdl_trigger_point("linear"),
        UPCAST_DOT=upcast, DOT_PRECISION=precision,
        BLOCK_M=BLOCK_M, BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_K=config.block_k, BLOCK_N=config.block_n,
        **trace_args(f"mlp {I}x{H} in {programs} slices", grid, part),
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(pdl),
    )
    return part


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
    from batchd.kernels.small_matmul.reference import NormInputs

    M, H = x.shape
    I = down_t.shape[0]
    if config is None:
        config = choose_mlp_config(I, H, x.dtype, x.device)
    pdl = pdl_enabled(x.device)
    if config.stream:
        from batchd.kernels.fused_mlp.stream_kernel import stream_mlp_partials

        part = stream_mlp_partials(x, row_sumsq, gate_up, down_t, eps=eps, ring_bytes=config.ring_kb << 10,
                                   ctas=config.programs)
    else:
        part = _triton_partials(x, row_sumsq, gate_up, down_t, eps, config, pdl)
    programs = part.shape[0]
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


__all__ = ["FusedMlpConfig", "TUNED", "choose_mlp_config", "fused_mlp_triton", "measured_faster"]
