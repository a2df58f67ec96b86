"""Attention of new query rows against the KV cache, dispatched to the best available path.

Visibility is lower-right causal: with `start` rows already cached and T new rows, lane t sees
cache rows [0, start + t]. PyTorch's `is_causal=True` is top-left aligned, so it is only used when
the cache was empty (start == 0); every other case passes an explicit mask or uses our kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

# Widest verify the decode kernel serves; longer chunks (prefill) use SDPA.
MAX_KERNEL_QUERY_ROWS = 16


def kernel_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import kernels.decode_attention  # noqa: F401
    except ImportError:
        return False
    return True


def attend_cached(q, cache, layer_idx: int, start: int, scale: float, use_kernel: bool, seq_len_on_device=None):
    """Attention of q (rows just written at [start, start + T)) against layer `layer_idx` of the
    cache: sparse top-k blocks when the cache keeps block summaries, else `attend`."""
    k_cache, v_cache = cache.keys[layer_idx], cache.values[layer_idx]
    T = q.shape[2]
    if cache.block_summaries is None:
        return attend(q, k_cache, v_cache, start, scale, use_kernel, seq_len_on_device)
    summary = cache.block_summaries[layer_idx]
    summary.update(k_cache, summary.length, start + T)
    if T > MAX_KERNEL_QUERY_ROWS:
        return attend(q, k_cache, v_cache, start, scale, use_kernel)
    from kernels.sparse_attention import sparse_decode_attention

    # dense below the point where sparse removes half the rows (the kernel's rule); exact there
    return sparse_decode_attention(q, k_cache, v_cache, start + T, summary, top_k=cache.sparse_top_k,
                                   scale=scale, min_seq_len=start + T)


def attend(q, k_cache, v_cache, start: int, scale: float, use_kernel: bool, seq_len_on_device=None):
    """q: [B, Hq, T, D] new query rows; k_cache, v_cache: [B, Hkv, S_max, D] with the T new rows
    already written at [start, start + T). Returns [B, Hq, T, D].

    `seq_len_on_device` ([1] long, == start + T) lets CUDA-graph replays run without host state.
    """
    T = q.shape[2]
    if use_kernel and T <= MAX_KERNEL_QUERY_ROWS:
        from kernels.decode_attention import decode_attention

        seq_len = seq_len_on_device if seq_len_on_device is not None else start + T
        return decode_attention(q, k_cache, v_cache, seq_len, scale=scale)
    if seq_len_on_device is not None:
        # graph replay without our kernel: attend over the whole buffer, masking by device length
        visible_end = seq_len_on_device - T + torch.arange(T, device=q.device)  # [T]
        cols = torch.arange(k_cache.shape[2], device=q.device)
        mask = cols[None, :] <= visible_end[:, None]
        return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, scale=scale, enable_gqa=True)
    keys, values = k_cache[:, :, : start + T], v_cache[:, :, : start + T]
    if T == 1:
        return F.scaled_dot_product_attention(q, keys, values, scale=scale, enable_gqa=True)
    if start == 0:
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    # CausalBias lets SDPA pick a fused kernel without materialising a [T, start + T] mask
    mask = causal_lower_right(T, start + T)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)


def lower_right_causal_mask(num_queries: int, num_keys: int, device) -> torch.Tensor:
    """[T, S] bool: query t sees keys <= S - T + t."""
    rows = torch.arange(num_queries, device=device)[:, None]
    cols = torch.arange(num_keys, device=device)[None, :]
    return cols <= rows + (num_keys - num_queries)
