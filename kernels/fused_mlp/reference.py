"""Plain PyTorch twin of the fused MLP (the definition the Triton kernels are tested against).

    act = silu(x Wg^T * s) * (x Wu^T * s)     # s: the folded RMSNorm's row scale, rounded as eagerly
    out = residual + act Wd^T                 # Wd^T given as down_t [I, H]

Each row is computed on its own in float32 (rounded to the model dtype where the eager layer
rounds: gate, up, silu(gate), act, the product before the residual), so row i depends on x[i]
alone. The Triton kernels sum act Wd^T in another order (per-program slices of I, then the slices
in order); tests compare them by relative error, and rows against rows bit for bit.
"""
from __future__ import annotations

import torch

from batchd.kernels.small_matmul.reference import norm_inputs_reference, small_linear_reference


def fused_mlp_reference(
    x: torch.Tensor,                 # [M, H] norm_weight * h (the post-attention norm's inputs)
    row_sumsq: torch.Tensor,         # [P, M] f32 sums of squares of h, in parts
    gate_up: torch.Tensor,           # [2I, H] gate rows, then up rows
    down_t: torch.Tensor,            # [I, H] the down projection's weight, transposed
    residual: torch.Tensor,          # [M, H]
    *,
    eps: float = 1e-6,
    emit_norm_weight: torch.Tensor | None = None,   # [H]: also return the next norm's inputs
):
    """-> out [M, H] in x's dtype, or (out, NormInputs) with emit_norm_weight."""
    act = small_linear_reference(x, gate_up, row_sumsq=row_sumsq, eps=eps, gated=True)   # [M, I]
    out = small_linear_reference(act, down_t.t(), residual=residual)   # one row at a time, float32
    if emit_norm_weight is not None:
        return out, norm_inputs_reference(out, emit_norm_weight)
    return out
