"""kernels.paged_attention at decode shapes: microseconds a launch and the KV bytes it reads per
second, against the copy bandwidth measured in the same run, for launch configurations.

Run on the H200:  python bench/paged_attention.py            (Llama-3-8B's heads, 64 rows of ~4.2K keys)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import copy_bandwidth, cuda_time, print_table  # noqa: E402
from batchd.kernels.paged_attention.triton_kernel import paged_decode_attention_triton  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--length", type=int, default=4224)
    parser.add_argument("--heads", default="32,8,128", help="Hq,Hkv,D")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--configs", default="8:4:2,8:4:3,8:8:3,16:4:3,16:8:3,4:4:3",
                        help="split_blocks:num_warps:num_stages, comma separated")
    args = parser.parse_args()
    Hq, Hkv, D = map(int, args.heads.split(","))
    bs, n = args.block_size, args.rows
    per_seq = -(-args.length // bs)
    # four layers' pools in turn, so the L2 holds none of the keys a launch reads
    pools = [(torch.randn(n * per_seq + 1, Hkv, bs, D, device="cuda", dtype=torch.bfloat16),
              torch.randn(n * per_seq + 1, Hkv, bs, D, device="cuda", dtype=torch.bfloat16)) for _ in range(4)]
    tables = torch.randperm(n * per_seq, device="cuda", dtype=torch.int64).to(torch.int32).view(n, per_seq)
    lens = torch.full((n,), args.length, device="cuda", dtype=torch.int32)
    q = torch.randn(n, Hq, D, device="cuda", dtype=torch.bfloat16)
    kv_bytes = 2 * n * args.length * Hkv * D * 2
    bandwidth = copy_bandwidth()
    rows = []
    for config in args.configs.split(","):
        split, warps, stages = map(int, config.split(":"))
        layer = [0]

        def launch():
            k, v = pools[layer[0] % 4]
            layer[0] += 1
            paged_decode_attention_triton(q, k, v, tables, lens, scale=D**-0.5, max_seq_len=args.length + 64,
                                          split_blocks=split, num_warps=warps, num_stages=stages)

        seconds = cuda_time(launch, warmup=8, repeats=40)
        rows.append({"split_blocks": split, "warps": warps, "stages": stages, "us": seconds * 1e6,
                     "KV TB/s": kv_bytes / seconds / 1e12, "of copy": kv_bytes / seconds / bandwidth})
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; {n} rows x {args.length} keys, heads {Hq}/{Hkv}, D {D}")
    print_table(rows)


if __name__ == "__main__":
    main()
