"""The PFlash scoring pass: how much attention the prompt's last T query rows pay to each key.

    key_scores = score_tail_queries(q_tail, k)      # q_tail [Hq, T, D], k [Hkv, S, D] -> [S] float32

score[s] = max over query heads of the mean over the T tail rows of softmax(q k^T * scale)[h, t, s],
where tail row t sits at position S - T + t and sees keys 0 .. S - T + t. The PFlash driver calls it
once per drafter layer (T = 8) and takes the max over layers; pooling and chunking are its own.
The Triton path never stores the [Hq, T, S] probabilities.
"""
from __future__ import annotations

import math

import torch

from batchd.kernels._backend import resolve_backend
from batchd.kernels.chunk_scoring.reference import score_tail_queries_reference

MAX_TAIL_ROWS = 64
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def score_tail_queries(
    q_tail: torch.Tensor,            # [Hq, T, D]: the last T query rows, post-rope
    k: torch.Tensor,                 # [Hkv, S, D]: all S keys, the tail's own included
    *,
    scale: float | None = None,      # default 1/sqrt(D)
    backend: str = "auto",           # "auto" | "triton" | "reference"
) -> torch.Tensor:
    """-> key_scores [S] float32, each in [0, 1]."""
    if q_tail.dim() != 3 or k.dim() != 3:
        raise ValueError(f"expected q_tail [Hq, T, D] and k [Hkv, S, D], got {list(q_tail.shape)} and {list(k.shape)}")
    Hq, T, D = q_tail.shape
    Hkv, S, Dk = k.shape
    if Dk != D:
        raise ValueError(f"q_tail head dim {D} != k head dim {Dk}")
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    if not 1 <= T <= min(S, MAX_TAIL_ROWS):
        raise ValueError(f"tail rows must be in 1..min(S={S}, {MAX_TAIL_ROWS}), got {T}")
    if q_tail.dtype not in DTYPES or k.dtype != q_tail.dtype:
        raise ValueError(f"q_tail and k must share one dtype of {DTYPES}, got {q_tail.dtype} and {k.dtype}")
    if q_tail.device != k.device:
        raise ValueError(f"q_tail on {q_tail.device} but k on {k.device}")
    if q_tail.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"q_tail and k must be contiguous in the head dim, got strides {q_tail.stride()}, {k.stride()}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if resolve_backend(backend, k.device) == "reference":
        return score_tail_queries_reference(q_tail, k, scale)
    from batchd.kernels.chunk_scoring.triton_kernel import score_tail_queries_triton

    return score_tail_queries_triton(q_tail, k, scale)


__all__ = ["score_tail_queries", "score_tail_queries_reference"]
