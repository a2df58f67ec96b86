"""RMSNorm, optionally fused with the residual add before it, row-invariant on CUDA.

    normed, h = rms_norm(x, weight, eps, residual=None)   # h = x + residual (or x)

x, residual: [..., H] (rows contiguous); weight [H]; statistics in float32.

    y = rms_norm_f32(x, weight, eps, out_dtype)   # weight None: unweighted

DeepSeek V4's form: x / rms(x) and its product with the weight in float32, rounded once to
out_dtype (the Llama form above rounds before the weight). One program per row on CUDA too.
"""
from __future__ import annotations

from batchd.kernels._backend import resolve_backend
from batchd.kernels.rms_norm.reference import rms_norm_f32_reference, rms_norm_reference


def rms_norm(x, weight, eps: float, residual=None, *, backend: str = "auto"):
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight {list(weight.shape)} does not match the last dim of x {list(x.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {list(residual.shape)} and x {list(x.shape)} differ")
    if resolve_backend(backend, x.device) == "reference" or x.dtype != weight.dtype:
        return rms_norm_reference(x, weight, eps, residual)
    from batchd.kernels.rms_norm.triton_kernel import rms_norm_triton

    return rms_norm_triton(x.contiguous(), weight, eps, None if residual is None else residual.contiguous())


def rms_norm_f32(x, weight, eps: float, out_dtype, *, backend: str = "auto"):
    if weight is not None and weight.shape != (x.shape[-1],):
        raise ValueError(f"weight {list(weight.shape)} does not match the last dim of x {list(x.shape)}")
    if resolve_backend(backend, x.device) == "reference" or x.shape[-1] == 0:
        return rms_norm_f32_reference(x, weight, eps, out_dtype)
    from batchd.kernels.rms_norm.triton_kernel import rms_norm_f32_triton

    return rms_norm_f32_triton(x.contiguous(), None if weight is None else weight.contiguous(), eps, out_dtype)


__all__ = ["rms_norm", "rms_norm_reference", "rms_norm_f32", "rms_norm_f32_reference"]
