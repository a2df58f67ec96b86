"""Attention kernels for batchd: each op a plain PyTorch reference twin plus a Triton kernel.

- decode_attention: decode/verify attention (Q = 1..16 rows per sequence) over a bf16/f16/f32 KV
  cache read in its own dtype; flash-decoding split over the key axis (on short caches on sm_90 a
  CUDA kernel whose splits merge within a thread-block cluster, one launch).
- sparse_decode_attention (+ BlockKeySummary): top-k key blocks per lane at long context, exact
  dense attention where sparsity would keep half the rows or more.
- score_tail_queries: the PFlash scoring pass, tail queries against all keys.
- small_linear: a projection of up to 32 rows whose per-row result does not depend on the row
  count (decode and verify agree bitwise), faster than cuBLAS at decode shapes.
- rms_norm: RMSNorm (after an optional residual add), one program and reduction order per row.
- moe_experts: MoE routed experts (DeepSeek V4's clamped SwiGLU) as a grouped GEMM over tokens sorted
  by expert, reading only the chosen experts; a token's output independent of the batch.
- rope_and_store: q/k rotary embedding (and qwen3's q/k norm) plus the k/v cache write, one launch.
- rope_paged_store: rope of a batch's q/k rows plus the k/v write into the paged pool, one launch,
  the eager ops' roundings.
- silu_mul: silu(gate) * up of a prefill chunk's gate_up rows, eager PyTorch's roundings.

backend="auto" runs Triton on CUDA and the reference elsewhere. This package imports neither
`batchd` nor `engine`, and imports `triton` only when a Triton kernel is used.
"""
from batchd.kernels.chunk_scoring import score_tail_queries
from batchd.kernels.decode_attention import decode_attention
from batchd.kernels.moe_experts import moe_experts
from batchd.kernels.rms_norm import rms_norm
from batchd.kernels.rope_cache import rope_and_store
from batchd.kernels.rope_paged import rope_paged_store
from batchd.kernels.silu_mul import silu_mul
from batchd.kernels.small_matmul import small_linear
from batchd.kernels.sparse_attention import BlockKeySummary, sparse_decode_attention, sparse_is_worthwhile

__all__ = [
    "decode_attention",
    "moe_experts",
    "sparse_decode_attention",
    "sparse_is_worthwhile",
    "BlockKeySummary",
    "score_tail_queries",
    "small_linear",
    "rope_and_store",
    "rope_paged_store",
    "rms_norm",
    "silu_mul",
]
