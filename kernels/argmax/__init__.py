"""Greedy pick: the index of each row's largest logit, the first one on ties (torch.argmax's rule).

    ids = argmax_rows(logits)        # logits [M, V] (bf16/f16/f32, rows contiguous) -> [M] int64
    pick_and_advance(logits, picked, next_token, length)
        # the end of a greedy chain step (engine.step): logits [1, V]; id = the argmax;
        # picked[length] = id ([max_len] int64), next_token[...] = id ([1, 1] int64), length += 1
        # ([1] int64), all on the device: in the argmax's second launch on CUDA

On CUDA two launches with programmatic dependent launch: blocks of the row in parallel, then their
winners; torch.argmax spends a single-block reduction (8 us at V = 152K on the H200) plus the
float32 copy of the logits it is usually given. Only ties, never rounding, can decide the result,
so the kernel and the reference agree exactly (NaN logits: unspecified).
"""
from __future__ import annotations

import torch

from batchd.kernels._backend import resolve_backend
from batchd.kernels.argmax.reference import argmax_rows_reference


def argmax_rows(logits: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    if logits.dim() != 2 or logits.shape[1] < 1:
        raise ValueError(f"expected logits [M, V] with V >= 1, got {list(logits.shape)}")
    if resolve_backend(backend, logits.device) == "reference" or logits.stride(1) != 1:
        return argmax_rows_reference(logits)
    from batchd.kernels.argmax.triton_kernel import argmax_rows_triton

    return argmax_rows_triton(logits)


def pick_and_advance(logits: torch.Tensor, picked: torch.Tensor, next_token: torch.Tensor, length: torch.Tensor,
                     *, backend: str = "auto") -> None:
    if logits.dim() != 2 or logits.shape[0] != 1 or logits.shape[1] < 1:
        raise ValueError(f"expected the logits of one row [1, V], got {list(logits.shape)}")
    for name, t in (("picked", picked), ("next_token", next_token), ("length", length)):
        if t.dtype != torch.int64 or not t.is_contiguous() or t.device != logits.device:
            raise ValueError(f"{name} must be a contiguous int64 tensor on {logits.device}, got {t.dtype} on {t.device}")
    if next_token.numel() != 1 or length.numel() != 1 or picked.dim() != 1:
        raise ValueError(f"expected picked [max_len], next_token and length of one element, got "
                         f"{list(picked.shape)}, {list(next_token.shape)}, {list(length.shape)}")
    if resolve_backend(backend, logits.device) == "reference" or logits.stride(1) != 1:
        ids = argmax_rows_reference(logits)                 # [1]
        picked.index_copy_(0, length, ids)
        next_token.copy_(ids.view_as(next_token))
        length.add_(1)
        return
    from batchd.kernels.argmax.triton_kernel import argmax_rows_triton

    argmax_rows_triton(logits, record=(picked, next_token, length))


__all__ = ["argmax_rows", "argmax_rows_reference", "pick_and_advance"]
