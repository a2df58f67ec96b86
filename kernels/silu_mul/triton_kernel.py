"""silu(gate) * up over a 2-D grid of [BLOCK_M rows, BLOCK_N columns] tiles.

The torch.compile'd `engine.fused.silu_mul` (dynamic shapes) reached about a quarter of the H200's
copy bandwidth on prefill chunks (96 us a layer for 4,096 rows of Qwen2.5-0.5B); its flat index
splits each element's offset by the runtime width. Here a program's rows and columns come from its
two grid coordinates, with no division at all.

Roundings, all from float32 values: gate and up are read in the input dtype and widened (exact);
s = gate / (1 + exp(-gate)) is rounded to the input dtype; s * up is rounded to the input dtype.
Compiled, exp is libdevice's expf and the division is IEEE (div_rn), the functions eager PyTorch's
CUDA silu calls, so the result is the reference twin's (and eager `F.silu(gate) * up`'s) bit for bit
wherever those agree; Triton's own `tl.exp` and `/` are approximations (ex2.approx, div.full). The
CPU interpreter has no libdevice: it takes numpy's float32 exp there.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from batchd.kernels._backend import interpreting, launch_options, patch_interpreter_index, pdl_enabled
from batchd.kernels._pdl import AFTER_WAIT, pdl_wait

if interpreting():
    patch_interpreter_index()


@triton.jit
def _silu_mul_kernel(GateUp, Out, M, I, stride_in, stride_out,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
                     USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL, AFTER_WAIT)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)                # [BLOCK_M]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                # [BLOCK_N]
    ok = (rows < M)[:, None] & (cols < I)[None, :]                           # [BLOCK_M, BLOCK_N]
    src = GateUp + (rows.to(tl.int64) * stride_in)[:, None] + cols[None, :]
    dtype = Out.dtype.element_ty
    g = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(src + I, mask=ok, other=0.0).to(tl.float32)
    if LIBDEVICE_EXP:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    s = tl.math.div_rn(g, 1.0 + e).to(dtype).to(tl.float32)
    dst = Out + (rows.to(tl.int64) * stride_out)[:, None] + cols[None, :]
    tl.store(dst, (s * up).to(dtype), mask=ok)


def tile_shape(rows: int, width: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): up to 1,024 columns and 4,096 elements a tile, no more rows than there are."""
    block_n = min(1024, triton.next_power_of_2(width))
    block_m = min(max(1, 4096 // block_n), triton.next_power_of_2(rows))
    return block_m, block_n


def silu_mul_triton(gate_up: torch.Tensor, block_m: int | None = None, block_n: int | None = None,
                    num_warps: int = 4) -> torch.Tensor:
    """gate_up [..., 2I] contiguous -> [..., I]; block_m, block_n default to `tile_shape`."""
    width = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * width)
    M = rows.shape[0]
    out = torch.empty(M, width, dtype=gate_up.dtype, device=gate_up.device)
    if M and width:
        default_m, default_n = tile_shape(M, width)
        block_m, block_n = block_m or default_m, block_n or default_n
        pdl = pdl_enabled(gate_up.device)
        _silu_mul_kernel[(triton.cdiv(M, block_m), triton.cdiv(width, block_n))](
            rows, out, M, width, rows.stride(0), out.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, LIBDEVICE_EXP=not interpreting(), USE_PDL=pdl,
            num_warps=num_warps, **launch_options(pdl),
        )
    return out.view(*gate_up.shape[:-1], width)
