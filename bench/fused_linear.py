"""Cost of each small_linear fusion at decode shapes: one-row CUDA-graph replays over weight copies
that do not fit in L2, per variant, against the plain projection of the same weight.

    python bench/fused_linear.py          (H200; BATCHD_PDL=0 isolates the kernels from launch overlap)
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table  # noqa: E402
from batchd.kernels.small_matmul.triton_kernel import small_linear_triton  # noqa: E402

SHAPES = {  # name: (N, K) of the stored weight
    "qwen2.5-1.5b qkv": (2048, 1536), "qwen2.5-1.5b o": (1536, 1536), "qwen2.5-1.5b gate_up": (17920, 1536),
    "qwen2.5-1.5b down": (1536, 8960), "llama-3-8b qkv": (6144, 4096), "llama-3-8b gate_up": (28672, 4096),
    "llama-3-8b down": (4096, 14336),
}


def time_graph(fn, copies: int) -> float:
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * copies)  # us per call


def main() -> None:
    rows = []
    for name, (N, K) in SHAPES.items():
        copies = max(4, (512 << 20) // (N * K * 2))
        weights = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5 for _ in range(copies)]
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        sumsq = torch.rand(1, 1, device="cuda") * K                      # RMSNorm folded in: x = w * h
        res = torch.randn(1, N, device="cuda", dtype=torch.bfloat16)
        next_nw = torch.ones(N, device="cuda", dtype=torch.bfloat16)
        variants = {
            "plain": lambda i: small_linear_triton(x, weights[i], None),
            "norm": lambda i: small_linear_triton(x, weights[i], None, row_sumsq=sumsq),
            "residual": lambda i: small_linear_triton(x, weights[i], None, residual=res),
            "residual+emit": lambda i: small_linear_triton(x, weights[i], None, residual=res, emit_norm_weight=next_nw),
            "norm+gated": lambda i: small_linear_triton(x, weights[i], None, row_sumsq=sumsq, gated=True),
        }
        row = {"shape": name, "MB": N * K * 2 / 1e6}
        for variant, fn in variants.items():
            row[variant + " us"] = time_graph(fn, copies)
        rows.append(row)
        print(row, flush=True)
        del weights
        torch.cuda.empty_cache()
    print_table(rows)


if __name__ == "__main__":
    main()
