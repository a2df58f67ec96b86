"""Batch-invariant linear for a few rows (decode and fused verification), bf16/f16/f32.

    out = small_linear(x, weight, bias)          # x [M, K], weight [N, K], bias [N] or None -> [M, N]

Decode-step fusions (each saves a launch per layer, which at batch 1 costs more than the bytes):
    h, post = small_linear(a, w_o, residual=h, emit_norm_weight=ln2.weight)   # h + a W^T, and the
              # NormInputs of h for the next projection's RMSNorm
    act = small_linear(post.weighted, w_gate_up, row_sumsq=post.sumsq, eps=ln2.eps, gated=True)
              # RMSNorm folded in; silu(x Wg^T) * (x Wu^T) of a stacked [gate; up] weight
    first = norm_inputs(h, ln1.weight)                                         # where no projection
              # wrote h (the engine gets the embedding's in the same launch: kernels.step_inputs)
    q = qkv_rope_and_store(first.weighted, w_qkv, b_qkv, row_sumsq=first.sumsq, cos=cos, sin=sin,
                           positions=pos, k_cache=k, v_cache=v, num_heads=Hq, num_kv_heads=Hkv)
              # the q/k/v projection with rope and the KV cache write in its epilogue -> rotated q
"""
from __future__ import annotations

import torch

from batchd.kernels._backend import resolve_backend
from batchd.kernels.rope_cache import check_rope_inputs, rope_and_store
from batchd.kernels.small_matmul.checks import MAX_ROWS, check_fusion_inputs, check_linear_inputs
from batchd.kernels.small_matmul.reference import NormInputs, norm_inputs_reference, small_linear_reference

def small_linear(
    x: torch.Tensor,                     # [M, K], M = 1..32, bf16/f16/f32, contiguous rows
    weight: torch.Tensor,                # [N, K] (nn.Linear layout; [2N, K] gate then up when gated)
    bias: torch.Tensor | None = None,    # [N], x's dtype
    *,
    row_sumsq: torch.Tensor | None = None,         # [P, M] f32: x = norm_weight * h, scale rows by RMSNorm's
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,          # [M, N]: returned plus the product
    gated: bool = False,                           # silu(x Wg^T) * (x Wu^T) -> [M, N]
    emit_norm_weight: torch.Tensor | None = None,  # [N]: also return the NormInputs of the output
    settled: bool = False,               # residual written two or more launches before this call
    backend: str = "auto",               # "auto" | "triton" | "reference"
):
    """x @ weight.T (+ bias) -> [M, N] in x's dtype, float32 accumulation, batch-invariant per row;
    (out, NormInputs) with emit_norm_weight. The fusions are defined by small_linear_reference.

    backend "auto" runs Triton on CUDA and the reference elsewhere; "triton" also runs on CPU under
    TRITON_INTERPRET=1. The Triton path never syncs the host and can be captured in a CUDA graph.
    Tile sizes and k splits are fixed per (N, K, dtype) (kernels/small_matmul/triton_kernel.py).
    settled=True promises that `residual` was written two or more kernel launches before this call
    (a decode layer's residual stream is): the reduce kernel of a k split may then read it before
    waiting on the launch just before (kernels._pdl, "Settled inputs"). Same bits either way.
    """
    check_linear_inputs(x, weight[: weight.shape[0] // 2] if gated else weight, bias)
    check_fusion_inputs(x, weight, bias, row_sumsq, residual, gated, emit_norm_weight)
    kwargs = dict(row_sumsq=row_sumsq, eps=eps, residual=residual, gated=gated, emit_norm_weight=emit_norm_weight)
    if resolve_backend(backend, x.device) == "reference":
        return small_linear_reference(x, weight, bias, **kwargs)
    from batchd.kernels.small_matmul.triton_kernel import small_linear_triton

    return small_linear_triton(x, weight, bias, settled=settled, **kwargs)


def qkv_rope_and_store(
    x: torch.Tensor,                     # [M = B * T, K] (norm_weight * h with row_sumsq)
    weight: torch.Tensor,                # [(Hq + 2 Hkv) * D, K], the fused q/k/v projection
    bias: torch.Tensor | None,           # [(Hq + 2 Hkv) * D] or None
    *,
    cos: torch.Tensor, sin: torch.Tensor,          # [T, D] float32 rope tables at the rows' positions
    positions: torch.Tensor,                       # [T] int64 cache rows (on the device)
    k_cache: torch.Tensor, v_cache: torch.Tensor,  # [B, Hkv, S_max, D]
    num_heads: int, num_kv_heads: int,
    row_sumsq: torch.Tensor | None = None, eps: float = 1e-6,
    settled: bool = False,                         # cos, sin, positions written two or more launches back
    backend: str = "auto",
) -> torch.Tensor:
    """The q/k/v projection of a decode or verify step and what follows it (kernels.rope_cache:
    rope of q and k, k/v rows into the caches) -> rotated q [B, Hq, T, D]. On CUDA in one launch
    where the projection's tile holds whole rope pairs (triton_kernel.rope_fits), else as the two
    launches; the bits are the same either way. settled=True (every decode layer but the first,
    whose tables the launch just before writes) lets the epilogue's table reads run before the
    kernel waits on that launch (kernels._pdl, "Settled inputs")."""
    check_linear_inputs(x, weight, bias)
    check_fusion_inputs(x, weight, bias, row_sumsq, None, False, None)
    B, T = k_cache.shape[0], x.shape[0] // k_cache.shape[0]
    if B * T != x.shape[0]:
        raise ValueError(f"x has {x.shape[0]} rows, not a multiple of the caches' batch {B}")
    check_rope_inputs(B, T, weight.shape[0], cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads)
    if resolve_backend(backend, x.device) == "triton" and x.dtype == k_cache.dtype:
        from batchd.kernels.small_matmul.triton_kernel import RopeTarget, choose_config, rope_fits, small_linear_triton

        N, K = weight.shape
        config = choose_config(N, K, x.dtype, x.device)
        if rope_fits(config, N, K, k_cache.shape[-1]):
            target = RopeTarget(cos.contiguous(), sin.contiguous(), positions, k_cache, v_cache, num_heads, num_kv_heads)
            return small_linear_triton(x, weight, bias, row_sumsq=row_sumsq, eps=eps, rope=target, settled=settled,
                                       config=config)
    qkv = small_linear(x, weight, bias, row_sumsq=row_sumsq, eps=eps, backend=backend)
    return rope_and_store(qkv.view(B, T, -1), cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads,
                          backend=backend)


def norm_inputs(h: torch.Tensor, norm_weight: torch.Tensor, *, backend: str = "auto") -> NormInputs:
    """h [M, K] -> NormInputs (norm_weight * h, sums of squares) for a projection with RMSNorm folded in."""
    if norm_weight.shape != (h.shape[-1],) or h.dim() != 2:
        raise ValueError(f"expected h [M, K] and norm_weight [K], got {list(h.shape)}, {list(norm_weight.shape)}")
    if resolve_backend(backend, h.device) == "reference" or h.dtype != norm_weight.dtype:
        return norm_inputs_reference(h, norm_weight)
    from batchd.kernels.small_matmul.triton_kernel import norm_inputs_triton

    return norm_inputs_triton(h.contiguous(), norm_weight)


__all__ = ["small_linear", "qkv_rope_and_store", "norm_inputs", "NormInputs", "check_fusion_inputs", "small_linear_reference", "check_linear_inputs", "MAX_ROWS"]
