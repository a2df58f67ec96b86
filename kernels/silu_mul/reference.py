"""PyTorch twin of the silu * up kernel: the same float32 arithmetic and the same two roundings."""
from __future__ import annotations

import torch


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2I] -> silu(gate) * up [..., I] in gate_up's dtype.

    s = gate / (1 + exp(-gate)) in float32, rounded to the dtype; then s * up in float32, rounded.
    That is what eager `F.silu(gate) * up` computes on CUDA (its silu divides by 1 + exp(-x) in
    float32, and a product of two low-precision tensors is formed in float32 and rounded)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    s = (gate / (1.0 + torch.exp(-gate))).to(gate_up.dtype).float()
    return (s * up).to(gate_up.dtype)
