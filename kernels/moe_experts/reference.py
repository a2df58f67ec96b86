"""Plain PyTorch twin of the grouped MoE experts (the definition the Triton kernel is tested against).

Each token on its own, its k experts in slot order (their rank in the token's top-k), float32
maths: row i of the result depends on x[i], weights[i] and experts[i] alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek V4's SwiGLU: silu of the gate clamped above at `limit`, times up clamped to ±limit."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def moe_experts_reference(
    x: torch.Tensor,            # [N, H]
    weights: torch.Tensor,      # [N, k] routing weights
    experts: torch.Tensor,      # [N, k] expert ids
    gate_up: torch.Tensor,      # [E, 2I, H]: gate rows then up rows
    down: torch.Tensor,         # [E, H, I]
    limit: float,
) -> torch.Tensor:
    """sum over slots s of weights[i, s] * down_e(clamped_swiglu(gate_up_e(x[i]))), e = experts[i, s],
    -> [N, H] in x's dtype. The activation is rounded to x's dtype before down (what the kernel
    feeds its second matmul); the slots' products are summed in float32, slot 0 first."""
    I = down.shape[2]
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        total = torch.zeros(x.shape[1], dtype=torch.float32, device=x.device)
        for slot in range(experts.shape[1]):
            e = int(experts[i, slot])
            gu = gate_up[e].float() @ x[i].float()                                     # [2I]
            act = clamped_swiglu(gu[:I], gu[I:], limit).to(x.dtype).float()            # [I]
            total += (down[e].float() @ act) * weights[i, slot].float()
        out[i] = total.to(x.dtype)
    return out
