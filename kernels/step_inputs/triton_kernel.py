"""One program per row m = b * T + t of a decode or verify step: its token's embedding row, that
row's folded-RMSNorm inputs, and (rows of batch 0) the position and its rope table rows; program 0
also writes start + T. Gathers are exact copies; the norm sums are small_matmul's norm_inputs kernel's
own code (`norm_row`), so the bits are those of the eager embedding followed by that kernel."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchd.kernels._backend import launch_options, pdl_enabled
from batchd.kernels._pdl import AFTER_WAIT, pdl_wait
from batchd.kernels.small_matmul.reference import NormInputs
from batchd.kernels.small_matmul.triton_kernel import norm_row, norm_row_launch
from batchd.kernels.step_inputs.reference import StepInputs


@triton.jit
def _step_inputs_kernel(
    Tokens, Start, Embed, RopeCos, RopeSin, NormW,
    Positions, SeqLen, Cos, Sin, Hidden, Weighted, SumSq,
    # Tokens [B, T] int64 (contiguous); Start [1] int64; Embed [V, H]; RopeCos, RopeSin [L, D] f32;
    # NormW [H]; Positions [T] int64; SeqLen [1] int64; Cos, Sin [T, D] f32; Hidden, Weighted [B*T, H];
    # SumSq [1, B*T] f32
    start_value, T, H, D, stride_embed,
    START_ON_DEVICE: tl.constexpr, NORM: tl.constexpr, USE_PDL: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pdl_wait(USE_PDL, AFTER_WAIT)  # the tokens and the length come from the step before
    m = tl.program_id(0)
    t = m % T
    if START_ON_DEVICE:
        start = tl.load(Start)
    else:
        start = start_value
    pos = start + t
    token = tl.load(Tokens + m)
    offs = tl.arange(0, BLOCK_H)
    ok = offs < H
    h = tl.load(Embed + token * stride_embed + offs, mask=ok, other=0.0)
    tl.store(Hidden + m * H + offs, h, mask=ok)
    if NORM:
        norm_row(h, NormW, Weighted, SumSq, m, H, offs, ok)
    if m < T:                                    # batch 0 writes what all rows share
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        tl.store(Positions + t, pos)
        tl.store(Cos + t * D + d, tl.load(RopeCos + pos * D + d, mask=d_ok), mask=d_ok)
        tl.store(Sin + t * D + d, tl.load(RopeSin + pos * D + d, mask=d_ok), mask=d_ok)
        if START_ON_DEVICE and m == 0:
            tl.store(SeqLen, start + T)


def step_inputs_triton(tokens, start, embed_weight, rope_cos, rope_sin, norm_weight):
    """Shapes are validated by the public wrapper (kernels.step_inputs.step_inputs)."""
    B, T = tokens.shape
    H, D = embed_weight.shape[1], rope_cos.shape[1]
    device = tokens.device
    on_device = isinstance(start, torch.Tensor)
    positions = torch.empty(T, dtype=torch.int64, device=device)
    seq_len = torch.empty(1, dtype=torch.int64, device=device) if on_device else None
    cos = torch.empty(T, D, dtype=rope_cos.dtype, device=device)
    sin = torch.empty_like(cos)
    hidden = torch.empty(B, T, H, dtype=embed_weight.dtype, device=device)
    norm = norm_weight is not None
    weighted = torch.empty(B * T, H, dtype=embed_weight.dtype, device=device) if norm else hidden
    sumsq = torch.empty(1, B * T, dtype=torch.float32, device=device) if norm else cos
    pdl = pdl_enabled(device)
    block_h, num_warps = norm_row_launch(H)   # norm_inputs_triton's launch: the same sums
    _step_inputs_kernel[(B * T,)](
        tokens, start if on_device else positions, embed_weight, rope_cos, rope_sin,
        norm_weight if norm else embed_weight, positions, seq_len if on_device else positions, cos, sin, hidden,
        weighted, sumsq,
        0 if on_device else int(start), T, H, D, embed_weight.stride(0),
        START_ON_DEVICE=on_device, NORM=norm, USE_PDL=pdl, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(D),
        num_warps=num_warps, **launch_options(pdl),
    )
    normed = NormInputs(weighted, sumsq) if norm else None
    return StepInputs(positions, seq_len, cos, sin, hidden, normed)


__all__ = ["step_inputs_triton"]
