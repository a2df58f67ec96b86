"""silu(gate) * up of a prefill chunk's gate_up projection, one bandwidth-bound launch on CUDA.

    act = silu_mul(gate_up)   # [..., 2I] (gate then up along the last axis) -> [..., I]

Computed in float32 and rounded as PyTorch's eager `F.silu(gate) * up` rounds in the input dtype:
silu(gate) = gate / (1 + exp(-gate)) rounded to the dtype, then its product with up rounded.
"""
from __future__ import annotations

import torch

from batchd.kernels._backend import resolve_backend
from batchd.kernels.silu_mul.reference import silu_mul_reference

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def silu_mul(gate_up: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up {list(gate_up.shape)} must end in an even width 2I (gate, then up)")
    if resolve_backend(backend, gate_up.device) == "reference" or gate_up.dtype not in KERNEL_DTYPES:
        return silu_mul_reference(gate_up)
    from batchd.kernels.silu_mul.triton_kernel import silu_mul_triton

    return silu_mul_triton(gate_up.contiguous())


__all__ = ["silu_mul", "silu_mul_reference"]
