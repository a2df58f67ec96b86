"""Attention of new query rows against the KV cache, dispatched to the best available path.

Visibility is lower-right causal: with `start` rows already cached and T new rows, lane t sees
cache rows [0, start + t]. PyTorch's `is_causal=True` is top-left aligned, so it is only used when
the cache was empty (start == 0); every other case passes an explicit mask or uses our kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from batchd.kernels.decode_attention import MAX_Q_ROWS, decode_attention
from batchd.kernels.sparse_attention import select_blocks, sparse_attention, sparse_decode_attention

# Widest verify the decode kernel serves; longer chunks (prefill) use SDPA.
MAX_KERNEL_QUERY_ROWS = 16
# Widest verify step (16 draft tokens + the last accepted one) that runs lane by lane on the CPU.
MAX_VERIFY_ROWS = 17


def kernel_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:  # kept from when the kernels were a package of their own that could be missing
        import batchd.kernels.decode_attention  # noqa: F401
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
    if seq_len_on_device is not None:
        return _attend_sparse_captured(q, cache, summary, k_cache, v_cache, start, scale, use_kernel, seq_len_on_device)
    summary.update(k_cache, summary.length, start + T)
    if T > MAX_KERNEL_QUERY_ROWS:
        return attend(q, k_cache, v_cache, start, scale, use_kernel)
    # dense below the point where sparse removes half the rows (the kernel's rule); exact there
    return sparse_decode_attention(q, k_cache, v_cache, start + T, summary, top_k=cache.sparse_top_k,
                                   scale=scale, min_seq_len=start + T)


def _attend_sparse_captured(q, cache, summary, k_cache, v_cache, start, scale, use_kernel, seq_len_on_device):
    """A CUDA-graph step: the summary update and block choice read lengths on the device; whether
    this graph is a sparse or a dense one was decided on the host (StepRunner, cache.sparse_step)."""
    T = q.shape[2]
    summary.update_on_device(k_cache, seq_len_on_device - T, T)
    if not cache.sparse_step:
        return attend(q, k_cache, v_cache, start, scale, use_kernel, seq_len_on_device)
    block_ids = select_blocks(q, summary, seq_len_on_device, top_k=cache.sparse_top_k)
    return sparse_attention(q, k_cache, v_cache, seq_len_on_device, block_ids, block_size=summary.block_size,
                            scale=scale)


def attend(q, k_cache, v_cache, start: int, scale: float, use_kernel: bool, seq_len_on_device=None):
    """q: [B, Hq, T, D] new query rows; k_cache, v_cache: [B, Hkv, S_max, D] with the T new rows
    already written at [start, start + T). Returns [B, Hq, T, D].

    `seq_len_on_device` ([1] long, == start + T) lets CUDA-graph replays run without host state.
    """
    T = q.shape[2]
    if use_kernel and T <= MAX_VERIFY_ROWS:
        seq_len = seq_len_on_device if seq_len_on_device is not None else start + T
        return attend_kernel_lanes(q, k_cache, v_cache, seq_len, scale)
    if seq_len_on_device is not None:
        # graph replay without our kernel: attend over the whole buffer, masking by device length
        visible_end = seq_len_on_device - T + torch.arange(T, device=q.device)  # [T]
        cols = torch.arange(k_cache.shape[2], device=q.device)
        mask = cols[None, :] <= visible_end[:, None]
        return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, scale=scale, enable_gqa=True)
    keys, values = k_cache[:, :, : start + T], v_cache[:, :, : start + T]
    if not q.is_cuda and T <= MAX_VERIFY_ROWS and (start > 0 or T == 1):
        # a decode or verify step: each lane runs exactly its own decode step's call, so greedy
        # output does not change with speculation (a [T, S] SDPA moves the lanes' last bits with T)
        return torch.cat([attend_lane_cpu(q[:, :, t : t + 1], keys[:, :, : start + t + 1],
                                          values[:, :, : start + t + 1], scale) for t in range(T)], dim=2)
    if T == 1:
        return F.scaled_dot_product_attention(q, keys, values, scale=scale, enable_gqa=True)
    if start == 0:
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    # CausalBias lets SDPA pick a fused kernel without materialising a [T, start + T] mask
    mask = causal_lower_right(T, start + T)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)


def attend_kernel_lanes(q, k_cache, v_cache, seq_len, scale: float) -> torch.Tensor:
    """kernels.decode_attention over T <= 17 lanes. The kernel's tile holds 16 lanes per head; the
    widest verify (16 drafts + 1) runs as lanes 0..15 against a cache one row shorter, then lane 16.
    Each lane's rows are computed alone in the tile, so a lane is bitwise its decode step either way.

    settled=True: in a layer the kernel just before wrote only the T new rows (the q/k/v projection
    or its rope launch); the lengths and the older rows are from earlier launches (kernels._pdl)."""
    T = q.shape[2]
    if T <= MAX_Q_ROWS:
        return decode_attention(q, k_cache, v_cache, seq_len, scale=scale, settled=True)
    head = decode_attention(q[:, :, :MAX_Q_ROWS], k_cache, v_cache, seq_len - (T - MAX_Q_ROWS), scale=scale,
                            settled=True)
    tail = decode_attention(q[:, :, MAX_Q_ROWS:], k_cache, v_cache, seq_len, scale=scale, settled=True)
    return torch.cat([head, tail], dim=2)


def attend_lane_cpu(q, keys, values, scale: float) -> torch.Tensor:
    """One query row against every key it sees: q [B, Hq, 1, D], keys/values [B, Hkv, S, D] ->
    [B, Hq, 1, D]. The Hq / Hkv query heads sharing a key head go in as that head's query rows
    ([B, Hkv, Hq / Hkv, D], no mask: they see the same keys), which spares SDPA's GQA path its
    expansion of the keys and values (a quarter of a decode step's attention time on SmolLM2)."""
    B, Hq, _, D = q.shape
    Hkv = keys.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(B, Hkv, Hq // Hkv, D), keys, values, scale=scale)
    return out.view(B, Hq, 1, D)


def lower_right_causal_mask(num_queries: int, num_keys: int, device) -> torch.Tensor:
    """[T, S] bool: query t sees keys <= S - T + t."""
    rows = torch.arange(num_queries, device=device)[:, None]
    cols = torch.arange(num_keys, device=device)[None, :]
    return cols <= rows + (num_keys - num_queries)
