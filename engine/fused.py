"""The elementwise pieces of a layer, as pure tensor functions that can be fused.

Eagerly each is a handful of small kernels; at batch 1 a decode step of a 1.5B model would spend
more time launching them than reading weights. On CUDA `enable_fusion()` swaps in
`torch.compile`d versions (one Triton kernel each, dynamic in the token axis so one compile
serves decode, every verify width and every prefill chunk); norms run kernels.rms_norm (one
reduction order for any row count) and the q/k rope plus the cache write one launch
(kernels.rope_cache). The maths is identical on CPU, where the eager
versions run.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H]; statistics in float32, as the reference implementation computes them."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """Residual add then norm: returns (x + residual, rms_norm(x + residual))."""
    h = x + residual
    return h, rms_norm(h, weight, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos, sin: [T, D] float32, cast to x's dtype as HF does ("rotate half")."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2I] (gate then up) -> silu(gate) * up [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# kernels.rope_cache.rope_and_store on CUDA once enable_fusion() ran (None: the eager ops)
rope_kernel = None

_EAGER = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "rotate": rotate, "silu_mul": silu_mul}
_fused_on = False


def enable_fusion() -> None:
    """Replace the functions above by compiled ones (CUDA only; call once per process)."""
    global _fused_on, rms_norm, add_rms_norm, rotate, silu_mul, rope_kernel
    if _fused_on:
        return
    compiled = {name: torch.compile(fn, dynamic=True, fullgraph=True) for name, fn in _EAGER.items()}
    rms_norm, add_rms_norm = compiled["rms_norm"], compiled["add_rms_norm"]
    rotate, silu_mul = compiled["rotate"], compiled["silu_mul"]
    try:
        from batchd.kernels.rms_norm import rms_norm as norm_kernel
        from batchd.kernels.rope_cache import rope_and_store
    except ImportError:
        pass
    else:
        # Norms reduce over a row: torch.compile specialises one-row shapes and may split the
        # reduction there, so a decode row and the same row inside a verify step would differ
        # in the last bits. The kernel keeps one reduction order for any number of rows.
        rms_norm = lambda x, weight, eps: norm_kernel(x, weight, eps)[0]  # noqa: E731

        def add_rms_norm(x, residual, weight, eps):
            normed, h = norm_kernel(x, weight, eps, residual)
            return h, normed

        rope_kernel = rope_and_store
    _fused_on = True
