"""Decode and fused-verify attention over a bf16/f16/f32 KV cache, read in its own dtype.

    out = decode_attention(q, k_cache, v_cache, seq_len)

q holds Q = 1..16 new query rows per sequence whose K/V rows are already written at the end of the
valid region; lane i sees cache rows [0, seq_len - Q + i] (lower-right causal), which is what
decode (Q = 1) and fused verification of Q - 1 draft tokens (plus the bonus row) need.
"""
from __future__ import annotations

import math

import torch

from batchd.kernels._backend import resolve_backend, seq_len_tensor
from batchd.kernels.decode_attention import cluster_kernel
from batchd.kernels.decode_attention.reference import (
    MAX_Q_ROWS,
    causal_visibility,
    decode_attention_reference,
    masked_attention_reference,
)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Raise ValueError naming the numbers when the shapes, dtypes or devices do not fit together."""
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(
            f"expected q [B, Hq, Q, D] and caches [B, Hkv, S_max, D], got q {list(q.shape)}, "
            f"k_cache {list(k_cache.shape)}, v_cache {list(v_cache.shape)}"
        )
    B, Hq, QR, D = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {list(k_cache.shape)} and v_cache {list(v_cache.shape)} differ")
    Bk, Hkv, S_max, Dk = k_cache.shape
    if Bk != B or Dk != D:
        raise ValueError(f"q {list(q.shape)} does not match cache {list(k_cache.shape)} in batch or head dim")
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    if not 1 <= QR <= MAX_Q_ROWS:
        raise ValueError(f"q must hold 1..{MAX_Q_ROWS} query rows per sequence, got {QR}")
    if QR > S_max:
        raise ValueError(f"q has {QR} rows but the cache only {S_max}")
    if q.dtype not in DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"q, k_cache, v_cache must share one dtype of {DTYPES}, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if not (q.device == k_cache.device == v_cache.device):
        raise ValueError(f"q, k_cache, v_cache on different devices: {q.device}, {k_cache.device}, {v_cache.device}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head) dim, got strides {t.stride()}")


def decode_attention(
    q: torch.Tensor,                       # [B, Hq, Q, D], Q = 1..16
    k_cache: torch.Tensor,                 # [B, Hkv, S_max, D], same dtype as q, read in place
    v_cache: torch.Tensor,                 # [B, Hkv, S_max, D]
    seq_len: int | torch.Tensor,           # int or int64 [B]: valid rows INCLUDING the Q new rows
    *,
    scale: float | None = None,            # default 1/sqrt(D)
    backend: str = "auto",                 # "auto" | "cluster" | "triton" | "reference"
    settled: bool = False,                 # seq_len and the rows before the new ones written 2+ launches back
) -> torch.Tensor:
    """Attention of Q new rows per sequence over the cache. -> [B, Hq, Q, D] in q's dtype.

    float32 accumulation; GQA when Hq is a multiple of Hkv. seq_len must be >= Q for every sequence
    (a tensor is not checked, to keep the call free of host syncs; a lane that sees no row gets 0).
    backend "auto" runs, on CUDA, the one-launch cluster kernel (cluster_kernel.py: sm_90+, 16-bit
    caches of at most about 2048 rows, 1024 where many KV heads take clusters of 8) where the
    cache's shape fits it and Triton's split and merge kernels elsewhere, and the reference off
    CUDA; "cluster" insists on the cluster kernel; "triton" also runs on CPU under
    TRITON_INTERPRET=1. The choice depends on shapes only, never on Q or seq_len, so a verify lane
    still equals its decode step. With seq_len as a device tensor the GPU
    paths never sync the host and can be captured in a CUDA graph.

    settled=True promises that seq_len and the cache rows before the Q new ones were written two or
    more kernel launches before this call (in a decode step the new rows come from the launch just
    before, everything else from earlier ones): the kernels then read them before waiting on that
    launch (kernels._pdl, "Settled inputs"). The same bits either way.
    """
    check_attention_inputs(q, k_cache, v_cache)
    B, _, QR, D = q.shape
    S_max = k_cache.shape[2]
    if isinstance(seq_len, int) and seq_len < QR:
        raise ValueError(f"seq_len ({seq_len}) must count the {QR} new rows already written to the cache")
    lengths = seq_len_tensor(seq_len, B, S_max, q.device)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if backend in ("auto", "cluster"):
        plan = cluster_kernel.supported(q, k_cache, v_cache)
        if plan is not None:
            return cluster_kernel.decode_attention_cluster(q, k_cache, v_cache, lengths, scale, plan, settled=settled)
        if backend == "cluster":
            raise ValueError(
                f"the cluster attention kernel cannot run q {list(q.shape)} {q.dtype} on {q.device} over a cache of "
                f"{S_max} rows (it needs an sm_90+ GPU, bf16/f16, D a multiple of 32 up to 128, a short cache, "
                "KernelOptions.attention_cluster not 0): use backend='auto' or 'triton'")
        backend = "auto"
    if resolve_backend(backend, q.device) == "reference":
        return decode_attention_reference(q, k_cache, v_cache, lengths, scale)
    from batchd.kernels.decode_attention.triton_kernel import decode_attention_triton

    return decode_attention_triton(q, k_cache, v_cache, lengths, scale, settled=settled)


__all__ = [
    "decode_attention",
    "decode_attention_reference",
    "masked_attention_reference",
    "causal_visibility",
    "check_attention_inputs",
]
