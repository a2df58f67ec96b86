"""The MLP half of a decode or verify step (few rows) in two launches, batch-invariant per row.

    out, next_inputs = fused_mlp(post.weighted, post.sumsq, w_gate_up, w_down.t(), residual=h,
                                 eps=ln2.eps, emit_norm_weight=next_ln1.weight)
        # h + silu(x Wg^T) * (x Wu^T) Wd^T with the post-attention RMSNorm folded in (x holds
        # norm_weight * h', its sums of squares in post.sumsq), and the next norm's NormInputs

down_t is the down projection's weight transposed, [I, H] and contiguous: the engine stores that
weight transposed when it uses this path (engine.model.Transformer.use_fused_mlp), so
`down_proj.weight.t()` is a free view. On CUDA: kernels/fused_mlp/triton_kernel.py; elsewhere the
PyTorch twin (reference.py). The engine uses it on the MLP shapes where it measured faster than the
chain of small_matmul launches on the H200 (`fused_mlp_wanted`; BATCHD_FUSED_MLP=1 forces it, 0
turns it off): Qwen2.5-0.5B, +18%; at Qwen2.5-1.5B, Llama-3-8B and SmolLM2-135M the chain is
faster (docs/performance.md, "Stop 19"). `FusedMlpConfig(stream=True)` runs the slices on
a bulk-copy weight ring instead (stream_mlp.cu, stream_kernel.py; sm_90+, bf16/f16): correct and
batch-invariant, but slower than the chain in whole steps (NOTES, "Stop 25"), so in no table entry.
"""
from __future__ import annotations

import os

import torch

from batchd.kernels._backend import resolve_backend
from batchd.kernels.fused_mlp.reference import fused_mlp_reference
from batchd.kernels.small_matmul import check_fusion_inputs, check_linear_inputs


def fused_mlp_wanted(hidden: int, intermediate: int, dtype: torch.dtype) -> bool:
    """Whether the engine should run this model's decode and verify MLPs through the kernel (on
    CUDA). BATCHD_FUSED_MLP=1: wherever it fits; 0: never; unset: on the shapes where it measured
    faster than the chain (triton_kernel.TUNED: Qwen2.5-0.5B; not 1.5B, 8B or SmolLM2-135M,
    docs/performance.md "Stop 19")."""
    switch = os.environ.get("BATCHD_FUSED_MLP", "")
    if switch not in ("", "0", "1"):
        raise ValueError(f"BATCHD_FUSED_MLP is 0, 1 or unset, got {switch!r}")
    if switch == "0" or not mlp_fits(hidden, intermediate, dtype):
        return False
    if switch == "1":
        return True
    from batchd.kernels._backend import triton_available

    if not triton_available():
        return False
    from batchd.kernels.fused_mlp.triton_kernel import measured_faster

    return measured_faster(intermediate, hidden, dtype)


def mlp_fits(hidden: int, intermediate: int, dtype: torch.dtype) -> bool:
    """Whether the kernel takes this shape: H a multiple of 16 (its k and n steps divide H)."""
    return hidden % 16 == 0 and intermediate >= 8 and dtype in (torch.bfloat16, torch.float16, torch.float32)


def check_mlp_inputs(x, row_sumsq, gate_up, down_t, residual, emit_norm_weight) -> None:
    """Raise ValueError naming the numbers when the operands do not fit together."""
    check_linear_inputs(x, gate_up[: gate_up.shape[0] // 2], None)
    check_fusion_inputs(x, gate_up, None, row_sumsq, None, True, None)
    if row_sumsq is None:
        raise ValueError("the fused MLP folds the post-attention RMSNorm in: row_sumsq is required")
    intermediate, hidden = gate_up.shape[0] // 2, x.shape[1]
    if down_t.shape != (intermediate, hidden) or down_t.dtype != x.dtype or not down_t.is_contiguous():
        raise ValueError(f"down_t must be the down weight transposed, a contiguous [{intermediate}, {hidden}] "
                         f"{x.dtype} tensor, got {list(down_t.shape)} {down_t.dtype} strides {down_t.stride()}")
    if not gate_up.is_contiguous():
        raise ValueError(f"gate_up must be contiguous, got strides {gate_up.stride()}")
    check_fusion_inputs(x, down_t.t(), None, None, residual, False, emit_norm_weight)
    if residual is None:
        raise ValueError("the fused MLP adds its output to the residual stream: residual is required")


def fused_mlp(
    x: torch.Tensor,                 # [M, H], M = 1..32: norm_weight * h
    row_sumsq: torch.Tensor,         # [P, M] f32: h's sums of squares, in parts
    gate_up: torch.Tensor,           # [2I, H] gate rows then up rows, contiguous
    down_t: torch.Tensor,            # [I, H] down's weight transposed, contiguous
    *,
    residual: torch.Tensor,          # [M, H]
    eps: float = 1e-6,
    emit_norm_weight: torch.Tensor | None = None,   # [H]: also return the next norm's NormInputs
    settled: bool = False,           # residual written two or more launches back (kernels._pdl)
    backend: str = "auto",
    config=None,                     # triton_kernel.FusedMlpConfig: overrides the table (bench, tests)
):
    """-> out [M, H] in x's dtype (float32 accumulation), or (out, NormInputs) with emit_norm_weight.
    The maths is fused_mlp_reference's; nothing syncs the host (CUDA-graph capturable)."""
    check_mlp_inputs(x, row_sumsq, gate_up, down_t, residual, emit_norm_weight)
    if resolve_backend(backend, x.device) == "reference":
        return fused_mlp_reference(x, row_sumsq, gate_up, down_t, residual, eps=eps,
                                   emit_norm_weight=emit_norm_weight)
    from batchd.kernels.fused_mlp.triton_kernel import fused_mlp_triton

    return fused_mlp_triton(x, row_sumsq, gate_up, down_t, residual, eps=eps, emit_norm_weight=emit_norm_weight,
                            settled=settled, config=config)


__all__ = ["fused_mlp", "fused_mlp_reference", "fused_mlp_wanted", "check_mlp_inputs", "mlp_fits"]
