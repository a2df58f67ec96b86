"""The inputs of a decode or verify step in one launch: what used to be seven (position arange and
adds, two rope-table gathers, the embedding gather, the first norm's inputs), most of them plain
torch kernels that also break the chain of programmatic dependent launches.

    s = step_inputs(tokens, start, embed_weight, rope_cos, rope_sin, norm_weight)
        # tokens [B, T] int64; start: host int, or [1] int64 on the device (a graph replay);
        # embed_weight [V, H]; rope_cos, rope_sin [L, D] float32; norm_weight [H] or None
        # -> StepInputs(positions [T], seq_len [1] or None, cos/sin [T, D], hidden [B, T, H],
        #               normed = NormInputs of hidden for the first layer's RMSNorm, or None)

The results are those of the eager ops (step_inputs_reference) bit for bit: gathers copy, and the
norm sums run small_matmul's norm_inputs code. Positions past the rope tables are the caller's to
rule out (the engine reserves cache rows first).
"""
from __future__ import annotations

from typing import Optional

import torch

from batchd.kernels._backend import resolve_backend
from batchd.kernels.step_inputs.reference import StepInputs, step_inputs_reference


def step_inputs(tokens: torch.Tensor, start, embed_weight: torch.Tensor, rope_cos: torch.Tensor,
                rope_sin: torch.Tensor, norm_weight: Optional[torch.Tensor] = None, *,
                backend: str = "auto") -> StepInputs:
    if tokens.dim() != 2 or tokens.dtype != torch.int64:
        raise ValueError(f"tokens must be an int64 [B, T] tensor, got {tokens.dtype} {list(tokens.shape)}")
    if embed_weight.dim() != 2 or rope_cos.dim() != 2 or rope_sin.shape != rope_cos.shape:
        raise ValueError(f"expected embed_weight [V, H] and rope tables [L, D], got {list(embed_weight.shape)}, "
                         f"{list(rope_cos.shape)} and {list(rope_sin.shape)}")
    if isinstance(start, torch.Tensor) and (start.shape != (1,) or start.dtype != torch.int64):
        raise ValueError(f"a start on the device must be an int64 [1] tensor, got {start.dtype} {list(start.shape)}")
    if norm_weight is not None and norm_weight.shape != (embed_weight.shape[1],):
        raise ValueError(f"norm_weight must be [{embed_weight.shape[1]}], got {list(norm_weight.shape)}")
    exact_layout = (tokens.is_contiguous() and embed_weight.stride(1) == 1 and rope_cos.is_contiguous()
                    and rope_sin.is_contiguous() and (norm_weight is None or norm_weight.dtype == embed_weight.dtype))
    if resolve_backend(backend, tokens.device) == "reference" or not exact_layout:
        return step_inputs_reference(tokens, start, embed_weight, rope_cos, rope_sin, norm_weight)
    from batchd.kernels.step_inputs.triton_kernel import step_inputs_triton

    return step_inputs_triton(tokens, start, embed_weight, rope_cos, rope_sin, norm_weight)


__all__ = ["step_inputs", "step_inputs_reference", "StepInputs"]
