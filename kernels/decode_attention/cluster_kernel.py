"""Decode and fused-verify attention in one CUDA launch: a KV head's key splits form a thread-block
cluster and merge through distributed shared memory (cluster_attention.cu has the design).

The Triton path (triton_kernel.py) runs a split kernel and a merge kernel; at batch 1 and short
caches the merge launch costs more than its work (at Qwen2.5-1.5B, 512 tokens, skipping it made
decode steps 4.8% faster: docs/performance.md, "Stop 28"). Here each CTA of a cluster
holds its whole share of the cache in shared memory, so the kernel runs only where that share is
small: CLUSTER * MAX_KEYS_PER_CTA cache rows (2048 with 16 CTAs), bf16/f16, D a multiple of 32 up
to 128. `plan` says whether a call fits; decode_attention routes there on its own.

Which kernel runs depends only on the cache's shape, never on Q or seq_len, and this kernel's lane
arithmetic does not depend on Q either: a decode step and the verify lane at the same position get
the same bits (greedy output does not change with speculation).
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from batchd.kernels.decode_attention import MAX_Q_ROWS   # the plan must fit the widest verify

_SOURCE = Path(__file__).with_name("cluster_attention.cu")
_STREAM_HEADERS = Path(__file__).parents[1] / "stream_linear"   # stream_common.cuh
THREADS = 128
KEY_BLOCKS = (32, 64)       # keys a step of the kernel's online softmax; keys_per_cta is a multiple of it
DEFAULT_KEY_BLOCK = 32
D_SLICE = 32
MAX_KEYS_PER_CTA = 128     # an untimed cap (16 CTAs: 2048 rows; 8: 1024): past it each CTA's serial share
                           # grows, where the split and merge kernels spread a long cache over more programs
MAX_SHARED_MEM = 227 * 1024
CLUSTER_SIZES = (8, 16)     # 8 is the portable maximum; 16 needs the non-portable opt-in (sm_90 has it)


@dataclass(frozen=True)
class ClusterPlan:
    cluster: int          # CTAs a KV head
    keys_per_cta: int     # cache rows a CTA owns (a multiple of key_block)
    key_block: int        # keys a step of the online softmax
    shared_mem: int       # bytes a CTA asks


def key_block() -> int:
    """cluster_attention.cu's KEY_BLOCK from BATCHD_ATTENTION_KEY_BLOCK (32 or 64), a tuning switch
    read at each call. It moves a lane's bits (another block edge), but the same way for a decode
    step and its verify lane."""
    value = os.environ.get("BATCHD_ATTENTION_KEY_BLOCK", str(DEFAULT_KEY_BLOCK))
    if value not in map(str, KEY_BLOCKS):
        raise ValueError(f"BATCHD_ATTENTION_KEY_BLOCK is one of {KEY_BLOCKS}, got {value!r}")
    return int(value)


def cluster_size(heads: int, sms: int) -> int:
    """CTAs a cluster from BATCHD_ATTENTION_CLUSTER (8 or 16; 0 turns the kernel off), read at
    each call (bench/step_sweep.py sets it per variant). Unset: 16 where the clusters of all
    `heads` (batch * KV heads) take at most half of the GPU's `sms`, else 8. A cluster of 16 must fit
    in one GPC. At 2 KV heads (Qwen2.5-1.5B) 16 was faster, 960 against 935 tok/s; at 8 (Llama-3-8B,
    128 CTAs) 8 was, 247 against 239 (docs/performance.md, "Stop 29" and "Stop 32")."""
    value = os.environ.get("BATCHD_ATTENTION_CLUSTER", "")
    if value == "":
        return 16 if heads * 16 <= sms // 2 else 8
    if value not in ("0", *map(str, CLUSTER_SIZES)):
        raise ValueError(f"BATCHD_ATTENTION_CLUSTER is 0 (off) or one of {CLUSTER_SIZES}, got {value!r}")
    return int(value)


def plan(s_max: int, head_dim: int, group: int, q_rows: int, itemsize: int, cluster: int,
         key_block: int = DEFAULT_KEY_BLOCK) -> ClusterPlan | None:
    """The launch for a cache of s_max rows, or None where this kernel cannot take the shape. Whether
    it can depends on the cache and the head layout only, never on q_rows (the plan must fit a
    16-row verify whenever it fits a decode step, or the two would run different kernels); q_rows
    sizes only the shared memory asked."""
    if cluster not in CLUSTER_SIZES or itemsize != 2 or head_dim % D_SLICE or head_dim > 128 or head_dim % cluster:
        return None
    keys = -(-s_max // cluster)
    keys = -(-keys // key_block) * key_block
    if keys > MAX_KEYS_PER_CTA or _shared_bytes(keys, head_dim, group, MAX_Q_ROWS, cluster) > MAX_SHARED_MEM:
        return None
    return ClusterPlan(cluster, keys, key_block, _shared_bytes(keys, head_dim, group, q_rows, cluster))


def _shared_bytes(keys: int, head_dim: int, group: int, q_rows: int, cluster: int) -> int:
    """cluster_attention.cu's layout: K and V [keys, D + 8], q [m-tile rows, D + 8] (16-bit; G * Q
    rows padded to 16), then the pushed partials (f32): acc [cluster, rows, D / cluster] and
    (m, l) [cluster, rows], and the mbarrier they land on."""
    pitch_bytes = (head_dim + 8) * 2
    rows = group * q_rows
    padded = -(-rows // 16) * 16
    return 2 * keys * pitch_bytes + padded * pitch_bytes + rows * head_dim * 4 + cluster * rows * 2 * 4 + 8


def supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> ClusterPlan | None:
    """The plan for this call if the cluster kernel can run it (an sm_90+ GPU, 16-bit caches, rows
    of 16-byte-aligned pieces, a cache short enough), else None. Depends on shapes, dtypes and
    layouts only."""
    from batchd.kernels._backend import multiprocessor_count
    from batchd.kernels.stream_linear import cuda_supported

    if not cuda_supported(q.device) or q.dtype not in (torch.bfloat16, torch.float16):
        return None
    B, Hq, QR, D = q.shape
    Hkv, S_max = k_cache.shape[1], k_cache.shape[2]
    cluster = cluster_size(B * Hkv, multiprocessor_count(q.device))
    if not cluster:
        return None
    for t in (q, k_cache, v_cache):
        if t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:-1]):
            return None
    return plan(S_max, D, Hq // Hkv, QR, q.element_size(), cluster, key_block())


class _Args(ctypes.Structure):
    """cluster_attention.cu's `struct Args`, field for field."""
    _fields_ = [("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("seq_len", ctypes.c_void_p),
                ("out", ctypes.c_void_p),
                *((name, ctypes.c_longlong) for name in ("q_sb", "q_sh", "q_sq", "k_sb", "k_sh", "k_sn",
                                                         "v_sb", "v_sh", "v_sn", "o_sb", "o_sh", "o_sq")),
                ("h_kv", ctypes.c_int), ("q_rows", ctypes.c_int), ("keys_per_cta", ctypes.c_int),
                ("use_pdl", ctypes.c_int), ("trigger", ctypes.c_int), ("early", ctypes.c_int),
                ("qk_scale", ctypes.c_float), ("trace", ctypes.c_void_p), ("trace_row", ctypes.c_int)]


@functools.cache
def _source_text() -> str:
    return _SOURCE.read_text()


def _kernel(device: torch.device, dtype: torch.dtype, head_dim: int, group: int, p: ClusterPlan):
    from batchd.kernels._cuda_launch import compile_kernels
    from batchd.kernels.stream_linear import launch_switches

    options = (*launch_switches()[0], f"-I{_STREAM_HEADERS}", "-std=c++17", f"-DHEAD_DIM={head_dim}", f"-DGROUP={group}",
               f"-DCLUSTER={p.cluster}", f"-DKEY_BLOCK={p.key_block}", *(("-DSCALAR_F16",) if dtype == torch.float16 else ()))
    return compile_kernels(_source_text(), ("cluster_attention",), device, options,
                           max_shared_mem=MAX_SHARED_MEM)["cluster_attention"]


def decode_attention_cluster(
    q: torch.Tensor,           # [B, Hq, Q, D], bf16/f16
    k_cache: torch.Tensor,     # [B, Hkv, S_max, D]
    v_cache: torch.Tensor,     # [B, Hkv, S_max, D]
    seq_len: torch.Tensor,     # [B] int64 on q's device
    scale: float,
    p: ClusterPlan,            # from supported()
    *,
    settled: bool = False,
) -> torch.Tensor:
    """-> [B, Hq, Q, D] (memory [B, Q, Hq, D], as the o projection reads it). Shapes are checked
    by decode_attention; settled as there."""
    from batchd.kernels._backend import early_reads_enabled, pdl_enabled, pdl_trigger_point
    from batchd.kernels.stream_linear import trace_rows

    B, Hq, QR, D = q.shape
    Hkv = k_cache.shape[1]
    out = torch.empty(B, QR, Hq, D, dtype=q.dtype, device=q.device).transpose(1, 2)
    grid = p.cluster * B * Hkv
    pdl = pdl_enabled(q.device)
    args = _Args(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), seq_len.data_ptr(), out.data_ptr(),
                 *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], *out.stride()[:3],
                 Hkv, QR, p.keys_per_cta, int(pdl), pdl_trigger_point("split"), int(settled and early_reads_enabled()),
                 scale * math.log2(math.e), *trace_rows(f"attention cluster x{p.cluster}", grid, out))
    kernel = _kernel(q.device, q.dtype, D, Hq // Hkv, p)
    kernel.launch(grid, THREADS, p.shared_mem, args, pdl=pdl, cluster=p.cluster)
    return out


__all__ = ["decode_attention_cluster", "supported", "plan", "cluster_size", "ClusterPlan", "CLUSTER_SIZES"]
