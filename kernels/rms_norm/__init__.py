"""RMSNorm, optionally fused with the residual add before it, row-invariant on CUDA.

    normed, h = rms_norm(x, weight, eps, residual=None)   # h = x + residual (or x)

x, residual: [..., H] (rows contiguous); weight [H]; statistics in float32.
"""
from __future__ import annotations

from batchd.kernels._backend import resolve_backend
from batchd.kernels.rms_norm.reference import rms_norm_reference


def rms_norm(x, weight, eps: float, residual=None, *, backend: str = "auto"):
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight {list(weight.shape)} does not match the last dim of x {list(x.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {list(residual.shape)} and x {list(x.shape)} differ")
    if resolve_backend(backend, x.device) == "reference" or x.dtype != weight.dtype:
        return rms_norm_reference(x, weight, eps, residual)
    from batchd.kernels.rms_norm.triton_kernel import rms_norm_triton

    return rms_norm_triton(x.contiguous(), weight, eps, None if residual is None else residual.contiguous())


__all__ = ["rms_norm", "rms_norm_reference"]
