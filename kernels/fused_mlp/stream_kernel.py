"""The fused MLP's slice kernel with bulk-copy weight streaming (CUDA, sm_90+): stream_mlp.cu.

    part = stream_mlp_partials(x, row_sumsq, gate_up, down_t, eps=eps)   # [G, M, H] f32

It computes what triton_kernel._fused_mlp_kernel computes (act for a slice of the intermediate
axis, times the slice's down rows), into the same float32 partials, so triton_kernel's ordered
reduce finishes both. A FusedMlpConfig with stream=True routes fused_mlp here. Design:
stream_mlp.cu; measurements: docs/performance.md, "Stop 25".
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from batchd.kernels.stream_linear import (CONSUMER_WARPS, MAX_ROWS, MAX_SHARED_MEM, THREADS, X_STAGE_BYTES, M_BUCKETS,
                                   StreamPlan, check_cuda_operands, chunk_units_for, compile_stream_kernels,
                                   ring_slots, trace_rows)

_SOURCE = Path(__file__).with_name("stream_mlp.cu")
COLUMNS_PER_THREAD_GROUP = 8 * CONSUMER_WARPS * 32                  # H columns one COL_GROUPS step covers


@dataclass(frozen=True)
class StreamMlpPlan(StreamPlan):
    """stream_linear's plan (CTAs are the slices, a chunk's units gate/up pairs) and the column
    groups of 8 x 256 output columns a consumer thread accumulates in the down phase."""
    col_groups: int


def plan_stream_mlp(M: int, intermediate: int, hidden: int, itemsize: int, *, sms: int,
                    ring_bytes: int) -> StreamMlpPlan:
    """The launch for x [M, H] and I intermediate rows. A slot holds cu (gate, up) row pairs or 2 cu
    down rows, cu the largest power of two up to 8 whose pairs fit SLOT_TARGET_BYTES (at least 1);
    the ring as many slots as ring_bytes and shared memory allow (2-16). Raises ValueError where
    the kernel cannot run the shape."""
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"the stream MLP takes 1..{MAX_ROWS} rows, got {M}")
    if hidden % 8:
        raise ValueError(f"the stream MLP needs H a multiple of 8 (16-byte row pieces), got {hidden}")
    pair_bytes = 2 * hidden * itemsize
    chunk_units = chunk_units_for(pair_bytes)
    slot_bytes = chunk_units * pair_bytes
    grid = min(sms, intermediate)
    x_bytes = M * hidden * itemsize
    stage_x = x_bytes <= X_STAGE_BYTES
    act_bytes = (-(-intermediate // grid) * M + 3) // 4 * 16      # [rows, M] f32, 16 B aligned
    tail = 256 + act_bytes + (x_bytes if stage_x else 0)
    num_slots, shared_mem = ring_slots(slot_bytes, tail, ring_bytes, MAX_SHARED_MEM, f"the stream MLP: H = {hidden}")
    bucket = next(b for b in M_BUCKETS if b >= M)
    return StreamMlpPlan(grid, chunk_units, slot_bytes, num_slots, stage_x, shared_mem, bucket,
                         -(-hidden // COLUMNS_PER_THREAD_GROUP))


class _MlpArgs(ctypes.Structure):
    """stream_mlp.cu's `struct MlpArgs`, field for field."""
    _fields_ = [("gate_up", ctypes.c_void_p), ("down_t", ctypes.c_void_p), ("x", ctypes.c_void_p),
                ("row_sumsq", ctypes.c_void_p), ("part", ctypes.c_void_p),
                ("M", ctypes.c_int), ("H", ctypes.c_int), ("I", ctypes.c_int), ("P", ctypes.c_int),
                ("eps", ctypes.c_float),
                ("chunk_units", ctypes.c_int), ("num_slots", ctypes.c_int), ("use_pdl", ctypes.c_int),
                ("stage_x", ctypes.c_int),
                ("trace", ctypes.c_void_p), ("trace_row", ctypes.c_int)]


def stream_mlp_partials(
    x: torch.Tensor,             # [M, H] bf16/f16, contiguous: norm_weight * h
    row_sumsq: torch.Tensor,     # [P, M] f32
    gate_up: torch.Tensor,       # [2I, H] contiguous
    down_t: torch.Tensor,        # [I, H] contiguous
    *,
    eps: float,
    ring_bytes: int,
    ctas: int = 0,               # CTAs (slices); 0: one per multiprocessor
) -> torch.Tensor:
    """-> part [G, M, H] f32, G = min(ctas or multiprocessors, I): slice b's sum of act down_t.
    Shapes are validated by kernels.fused_mlp.fused_mlp; this checks what only the CUDA kernel needs."""
    from batchd.kernels._backend import multiprocessor_count, pdl_enabled

    check_cuda_operands(x, "the stream MLP")
    x = x.contiguous()      # read at a row pitch of H
    M, H = x.shape
    intermediate = down_t.shape[0]
    sms = multiprocessor_count(x.device)
    p = plan_stream_mlp(M, intermediate, H, x.element_size(), sms=min(ctas or sms, sms), ring_bytes=ring_bytes)
    part = torch.empty(p.grid, M, H, dtype=torch.float32, device=x.device)
    pdl = pdl_enabled(x.device)
    args = _MlpArgs(gate_up.data_ptr(), down_t.data_ptr(), x.data_ptr(), row_sumsq.data_ptr(), part.data_ptr(),
                    M, H, intermediate, row_sumsq.shape[0], float(eps),
                    p.chunk_units, p.num_slots, int(pdl), int(p.stage_x),
                    *trace_rows(f"stream mlp {intermediate}x{H} in {p.grid} slices", p.grid, part))
    kernel = compile_stream_kernels(_SOURCE, "stream_mlp", x.device, x.dtype,
                                    (f"-DCOL_GROUPS={p.col_groups}",))[f"stream_mlp_m{p.m_bucket}"]
    kernel.launch(p.grid, THREADS, p.shared_mem, args, pdl=pdl)
    return part


__all__ = ["StreamMlpPlan", "plan_stream_mlp", "stream_mlp_partials"]
