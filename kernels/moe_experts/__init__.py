"""Routed MoE experts as a grouped GEMM (DeepSeek V4's clamped SwiGLU experts), batch-invariant per token.

    out = moe_experts(x, weights, experts, gate_up, down, limit)
    # x [N, H]; weights, experts [N, k] (the router's); gate_up [E, 2I, H] (gate rows, then up rows);
    # down [E, H, I] -> [N, H] = sum over slots of weights * down_e(clamped_swiglu(gate_up_e x))

Tokens are grouped by expert and only experts with tokens are read (kernels/moe_experts/triton_kernel.py).
"""
from __future__ import annotations

import torch

from batchd.kernels._backend import resolve_backend
from batchd.kernels.moe_experts.reference import clamped_swiglu, moe_experts_reference


def check_moe_inputs(x, weights, experts, gate_up, down) -> None:
    if x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"expected x [N, H], gate_up [E, 2I, H], down [E, H, I], got {list(x.shape)}, "
                         f"{list(gate_up.shape)}, {list(down.shape)}")
    N, H = x.shape
    E, H_down, I = down.shape
    if gate_up.shape != (E, 2 * I, H) or H_down != H:
        raise ValueError(f"gate_up {list(gate_up.shape)} and down {list(down.shape)} do not fit x {list(x.shape)}: "
                         f"want gate_up [E, 2I, {H}] and down [E, {H}, I] with the same E and I")
    if experts.dim() != 2 or experts.shape[0] != N or weights.shape != experts.shape:
        raise ValueError(f"weights {list(weights.shape)} and experts {list(experts.shape)} must both be [{N}, k]")
    if experts.dtype.is_floating_point:
        raise ValueError(f"experts must hold integer expert ids, got {experts.dtype}")


def moe_experts(
    x: torch.Tensor,              # [N, H]
    weights: torch.Tensor,        # [N, k] routing weights (any float dtype; used in float32)
    experts: torch.Tensor,        # [N, k] expert ids in 0..E-1
    gate_up: torch.Tensor,        # [E, 2I, H]
    down: torch.Tensor,           # [E, H, I]
    limit: float,                 # swiglu_limit
    *,
    backend: str = "auto",        # "auto" | "triton" | "reference"
    config=None,                  # triton_kernel.MoeConfig; None: the one for (H, I, dtype)
) -> torch.Tensor:
    """-> [N, H] in x's dtype, float32 accumulation; a token's row does not depend on the other rows.

    "auto" runs Triton on CUDA and the reference elsewhere; "triton" also runs on the CPU under
    TRITON_INTERPRET=1. Mixed dtypes (x not in the weights' dtype) take the reference."""
    check_moe_inputs(x, weights, experts, gate_up, down)
    if x.shape[0] == 0:
        return torch.empty_like(x)
    if resolve_backend(backend, x.device) == "reference" or not x.dtype == gate_up.dtype == down.dtype:
        return moe_experts_reference(x, weights, experts, gate_up, down, limit)
    from batchd.kernels.moe_experts.triton_kernel import moe_experts_triton

    return moe_experts_triton(x.contiguous(), weights, experts, gate_up.contiguous(), down.contiguous(), limit,
                              config)


__all__ = ["moe_experts", "moe_experts_reference", "clamped_swiglu", "check_moe_inputs"]
