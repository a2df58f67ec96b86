"""Projections whose rows do not depend on how many rows are computed together.

Greedy output must be bit-identical with speculation on or off, yet plain decode multiplies one
row (M = 1) and fused verification q + 1 rows. cuBLAS picks a different kernel per M, so the same
row comes out different in the last bits and a bf16 model's argmax can flip. On CUDA, steps of up
to `MAX_INVARIANT_ROWS` rows therefore go through `kernels.small_matmul`, whose per-row result is
independent of M (and which is also faster than cuBLAS at these shapes); prefill chunks, the same
in both paths, use cuBLAS. On the CPU, steps of 2..17 rows run as batched one-row products
(`rows_as_decode`), the same MKL kernel a one-token step uses.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MAX_INVARIANT_ROWS = 16
CPU_INVARIANT_ROWS = 17  # the widest verify step: 16 draft tokens plus the last accepted one
_small_linear = None


def enable_invariant_kernel() -> bool:
    """Use kernels.small_matmul for small steps on CUDA; False if it is not available."""
    global _small_linear
    try:
        from kernels.small_matmul import small_linear
    except ImportError:
        return False
    _small_linear = small_linear
    return True


def project(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """x: [B, T, K] -> [B, T, N] through `layer`'s weight and bias."""
    rows = x.shape[0] * x.shape[1]
    if _small_linear is not None and x.is_cuda and rows <= MAX_INVARIANT_ROWS:
        out = _small_linear(x.reshape(rows, x.shape[-1]), layer.weight, layer.bias)
        return out.view(*x.shape[:-1], -1)
    if x.device.type == "cpu" and 1 < rows <= CPU_INVARIANT_ROWS:
        return rows_as_decode(x.reshape(rows, x.shape[-1]), layer).view(*x.shape[:-1], -1)
    return F.linear(x, layer.weight, layer.bias)


def rows_as_decode(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """x: [M, K] -> [M, N] as M one-row products in one batched call. MKL runs each with the
    kernel of a one-row F.linear (a decode step), so every row matches decode bitwise, while a
    plain [M, K] GEMM's rows move in the last bits with M (tests/engine/test_spec_invariance.py).
    The weight stays hot in cache across the M products."""
    M = x.shape[0]
    weight = layer.weight.t().unsqueeze(0).expand(M, -1, -1)  # [M, K, N], a view
    x = x.unsqueeze(1)  # [M, 1, K]
    if layer.bias is None:
        return torch.bmm(x, weight).squeeze(1)
    return torch.baddbmm(layer.bias.view(1, 1, -1).expand(M, 1, -1), x, weight).squeeze(1)
