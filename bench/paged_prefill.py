"""kernels.paged_prefill against SDPA on contiguous keys (the flash path the one-sequence prefill
takes), at the Llama-3-8B attention shape (32 query heads, 8 KV heads, head dim 128, bf16).

Cases: C chunks of T rows, each starting at position P of its own sequence (P = 0: a whole prompt;
P > 0: a later chunk over its prefix). SDPA gets each chunk's keys contiguous (what a contiguous
cache holds), one call per chunk; the paged kernel reads them through block tables, one launch.

    python bench/paged_prefill.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import cuda_time, print_table  # noqa: E402
from batchd.kernels.paged_prefill import paged_prefill_attention  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 64


def case(chunks: int, rows: int, first: int):
    length = first + rows
    blocks = -(-length // BS)
    pool_k = torch.randn(chunks * blocks + 1, HKV, BS, D, device="cuda", dtype=torch.bfloat16)
    pool_v = torch.randn_like(pool_k)
    order = torch.randperm(chunks * blocks, device="cuda").to(torch.int32)
    tables = order.view(chunks, blocks)
    q = torch.randn(chunks * rows, HQ, D, device="cuda", dtype=torch.bfloat16)
    meta = [torch.tensor(x, dtype=torch.int32, device="cuda") for x in
            ([c * rows for c in range(chunks)], [rows] * chunks, [first] * chunks)]
    # the same keys, contiguous per chunk: [C, Hkv, S, D]
    keys = pool_k[tables.long()].permute(0, 2, 1, 3, 4).reshape(chunks, HKV, blocks * BS, D)[:, :, :length]
    values = pool_v[tables.long()].permute(0, 2, 1, 3, 4).reshape(chunks, HKV, blocks * BS, D)[:, :, :length]
    return q, pool_k, pool_v, tables, meta, keys.contiguous(), values.contiguous()


def main() -> None:
    rows_out = []
    for chunks, rows, first in [(1, 4096, 0), (8, 4096, 0), (16, 800, 0), (4, 4096, 4096), (2, 4096, 12288)]:
        q, pool_k, pool_v, tables, meta, keys, values = case(chunks, rows, first)
        paged = cuda_time(lambda: paged_prefill_attention(q, pool_k, pool_v, tables, *meta,
                                                          host_chunk_rows=[rows] * chunks))
        mask = None if first == 0 else (torch.arange(first + rows, device="cuda")[None, :]
                                        <= (first + torch.arange(rows, device="cuda"))[:, None])

        def sdpa():
            for c in range(chunks):
                qc = q[c * rows : (c + 1) * rows].transpose(0, 1)[None]
                F.scaled_dot_product_attention(qc, keys[c : c + 1], values[c : c + 1], attn_mask=mask,
                                               is_causal=first == 0, enable_gqa=True)

        flash = cuda_time(sdpa)
        flops = 4 * chunks * HQ * D * rows * (first + rows / 2)
        rows_out.append({"chunks x rows @ first": f"{chunks} x {rows} @ {first}", "paged ms": paged * 1e3,
                         "SDPA ms": flash * 1e3, "paged / SDPA": paged / flash, "paged TFLOP/s": flops / paged / 1e12})
    print_table(rows_out)


if __name__ == "__main__":
    main()
