"""The MLP half of a decode layer alone, three ways, on the H200: the chain of small_matmul launches
(gate/up, down's k split, its reduce), kernels.fused_mlp's Triton slices, and its bulk-copy stream
kernel (kernels/fused_mlp/stream_mlp.cu) at several ring sizes.

Each is a CUDA graph of calls over enough layer copies that nothing stays in the L2, programmatic
dependent launch on (as in a decode step), M = 1; us per layer and the MLP's weight bytes over it,
against the copy bandwidth measured in the same run. In a step the neighbours (o before, qkv after)
change this (kernels/small_matmul/NOTES.md, stop 23): bench/step_sweep.py's `mlp=I,H,stream,KB` is
the whole-step test.

    python bench/stream_mlp.py [--shapes qwen2.5-1.5b,llama-3-8b] [--rings 128,192]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import copy_bandwidth, graph_replay_time, print_table  # noqa: E402
from batchd.engine.presets import preset  # noqa: E402
from batchd.kernels.fused_mlp import fused_mlp  # noqa: E402
from batchd.kernels.fused_mlp.triton_kernel import FusedMlpConfig  # noqa: E402
from batchd.kernels.small_matmul import small_linear  # noqa: E402
from batchd.kernels.small_matmul.reference import norm_inputs_reference  # noqa: E402


def layer_copies(H: int, I: int, copies: int, gen: torch.Generator):
    """[(gate_up [2I, H], down [H, I], down_t [I, H])] per copy, bf16."""
    out = []
    for _ in range(copies):
        gate_up = (torch.randn(2 * I, H, generator=gen, device="cuda") * H**-0.5).to(torch.bfloat16)
        down_t = (torch.randn(I, H, generator=gen, device="cuda") * I**-0.5).to(torch.bfloat16)
        out.append((gate_up, down_t.t().contiguous(), down_t))
    return out


def timings(shape: str, rings: list[int], bandwidth: float) -> list[dict]:
    config = preset(shape)
    H, I = config.hidden_size, config.intermediate_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight_bytes = 3 * H * I * 2
    copies = max(2, -(-600_000_000 // weight_bytes))
    layers = layer_copies(H, I, copies, gen)
    h = torch.randn(1, H, generator=gen, device="cuda").to(torch.bfloat16)
    post = norm_inputs_reference(h, torch.ones(H, device="cuda", dtype=torch.bfloat16))
    norm_w = torch.ones(H, device="cuda", dtype=torch.bfloat16)

    def chain():
        for gate_up, down, _ in layers:
            act = small_linear(post.weighted, gate_up, row_sumsq=post.sumsq, eps=1e-6, gated=True)
            small_linear(act, down, residual=h, emit_norm_weight=norm_w)

    def fused(mlp_config):
        def run():
            for gate_up, _, down_t in layers:
                fused_mlp(post.weighted, post.sumsq, gate_up, down_t, residual=h, emit_norm_weight=norm_w,
                          config=mlp_config)
        return run

    variants = [("chain (small_matmul table)", chain), ("fused, Triton slices", fused(None))]
    variants += [(f"fused, stream ring {kb} KB", fused(FusedMlpConfig(stream=True, ring_kb=kb))) for kb in rings]
    rows = []
    for label, fn in variants:
        seconds = graph_replay_time(fn) / copies
        rows.append({"shape": shape, "MLP": f"{I}x{H}", "kernel": label, "us": round(seconds * 1e6, 2),
                     "TB/s": round(weight_bytes / seconds / 1e12, 2),
                     "of copy bw": round(weight_bytes / seconds / bandwidth, 3)})
    del layers
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen2.5-1.5b,llama-3-8b")
    parser.add_argument("--rings", default="96,128,192", help="ring sizes in KB, comma-separated")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    rings = [int(v) for v in args.rings.split(",")]
    print_table([row for shape in args.shapes.split(",") for row in timings(shape, rings, bandwidth)])


if __name__ == "__main__":
    main()
