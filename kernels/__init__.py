"""Attention kernels for batchd: each op a plain PyTorch reference twin plus a Triton kernel.

- decode_attention: decode/verify attention (Q = 1..16 rows per sequence) over a bf16/f16/f32 KV
  cache read in its own dtype; flash-decoding split over the key axis.
- sparse_decode_attention (+ BlockKeySummary): top-k key blocks per lane at long context, exact
  dense attention where sparsity would keep half the rows or more.
- score_tail_queries: the PFlash scoring pass, tail queries against all keys.

backend="auto" runs Triton on CUDA and the reference elsewhere. This package imports neither
`batchd` nor `engine`, and imports `triton` only when a Triton kernel is used.
"""
from kernels.chunk_scoring import score_tail_queries
from kernels.decode_attention import decode_attention
from kernels.sparse_attention import BlockKeySummary, sparse_decode_attention, sparse_is_worthwhile

__all__ = [
    "decode_attention",
    "sparse_decode_attention",
    "sparse_is_worthwhile",
    "BlockKeySummary",
    "score_tail_queries",
]
