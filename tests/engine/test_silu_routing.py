"""The CUDA choice's silu * up routes by row count (engine.fused.SILU_MUL_KERNEL_ROWS): decode and
verify rows stay on the compiled function. (Packed prompt chunks call kernels.silu_mul for any row
count: engine.batch.chunks.)"""
from __future__ import annotations

import torch

from batchd.engine import fused

KERNEL_MARK = 1000.0   # the stand-in kernel's outputs are the eager ones plus this


def routed():
    return fused.silu_mul_by_rows(fused.silu_mul, lambda gate_up: fused.silu_mul(gate_up) + KERNEL_MARK)


def took_kernel(gate_up, out) -> bool:
    return bool(torch.equal(out, fused.silu_mul(gate_up) + KERNEL_MARK))


def test_rows_below_the_threshold_take_the_compiled_function():
    silu_mul, rows = routed(), fused.SILU_MUL_KERNEL_ROWS
    for shape, kernel in [((1, 1, 8), False), ((1, 17, 8), False), ((rows - 1, 8), False),
                          ((rows, 8), True), ((2, rows // 2, 8), True), ((1, 4096, 8), True)]:
        gate_up = torch.randn(shape)
        assert took_kernel(gate_up, silu_mul(gate_up)) == kernel, shape
