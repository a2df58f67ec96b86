"""DeepSeek V4's routed experts: the grouped Triton GEMM (kernels.moe_experts) against the engine's
loop over experts (engine.deepseek_v4.moe.Experts.loop_over_experts), at V4-Flash's sizes
(transformers' DeepseekV4Config defaults: hidden 4096, expert intermediate 2048, 256 experts, top 6).

One layer's experts, random bf16 weights, random top-k routing (k distinct experts a token). Per
token count: milliseconds of each path, the kernel again replayed from a CUDA graph (no launch
gaps), and the fraction of the bytes roofline it reaches: bytes = the active experts' weights
(distinct experts chosen x 3 H I x 2 bytes), over the copy bandwidth measured in this run. The
shared expert (one more [I] SwiGLU MLP for every token) is not part of either path.

Run on the GPU:  python bench/v4_moe.py                  (1, 8, 64, 512 tokens)
                 python bench/v4_moe.py --tokens 1,4096
Smoke on a CPU:  python bench/v4_moe.py --smoke          (tiny sizes, the kernel interpreted)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import copy_bandwidth, cuda_time, graph_replay_time, print_table  # noqa: E402
from bench.v4_shapes import expert_bytes, v4_config  # noqa: E402


def cpu_time(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def random_routing(tokens: int, num_experts: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32 summing to 1.5 a token, experts [T, k]: k distinct a token, uniform)."""
    experts = torch.rand(tokens, num_experts, device=device).argsort(dim=1)[:, :k]
    weights = torch.rand(tokens, k, device=device)
    return 1.5 * weights / weights.sum(-1, keepdim=True), experts


def bench_tokens(experts_module, tokens: int, config, bandwidth: float | None) -> dict:
    from batchd.kernels.moe_experts import moe_experts

    device, dtype = experts_module.down_proj.device, experts_module.down_proj.dtype
    x = torch.randn(tokens, config.hidden_size, device=device).to(dtype)
    weights, experts = random_routing(tokens, config.num_experts, config.experts_per_token, device)
    args = (x, weights.to(dtype), experts, experts_module.gate_up_proj, experts_module.down_proj,
            experts_module.limit)
    kernel = lambda: moe_experts(*args, backend="triton")                  # noqa: E731
    loop = lambda: experts_module.loop_over_experts(x, weights.to(dtype), experts)   # noqa: E731
    got, want = kernel().float(), loop().float()
    active = experts.unique().numel()
    row = {"tokens": tokens, "active experts": active, "MB read": active * expert_bytes(config, dtype.itemsize) / 1e6,
           "rel err vs loop": ((got - want).norm() / want.norm()).item()}
    if device.type != "cuda":
        return dict(row, **{"kernel ms": cpu_time(kernel) * 1e3, "loop ms": cpu_time(loop) * 1e3})
    kernel_s, graph_s, loop_s = cuda_time(kernel), graph_replay_time(kernel), cuda_time(loop)
    roofline_s = row["MB read"] * 1e6 / bandwidth
    return dict(row, **{"kernel ms": kernel_s * 1e3, "graph ms": graph_s * 1e3, "loop ms": loop_s * 1e3,
                        "x loop": loop_s / kernel_s, "of roofline (graph)": roofline_s / graph_s})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,8,64,512", help="token counts, comma-separated")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, the kernel interpreted")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"      # before the kernel module is imported
    elif not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --smoke for a CPU check that it runs)")
    from batchd.engine.deepseek_v4.moe import Experts

    torch.manual_seed(0)
    config = v4_config(layers=1, tiny=args.smoke)
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    with torch.device("meta"):
        module = Experts(config)
    for name in ("gate_up_proj", "down_proj"):      # allocated once, in bf16, on the GPU (26 GB in float32)
        shape = getattr(module, name).shape
        setattr(module, name, torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device).normal_(0, 0.02),
                                                 requires_grad=False))
    bandwidth = None if args.smoke else copy_bandwidth()
    print(f"V4 experts: hidden {config.hidden_size}, intermediate {config.moe_intermediate_size}, "
          f"{config.num_experts} experts, top {config.experts_per_token}, {dtype}"
          + (f"; copy bandwidth {bandwidth / 1e12:.2f} TB/s" if bandwidth else ""), flush=True)
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        rows.append(bench_tokens(module, tokens, config, bandwidth))
        print(rows[-1], flush=True)
    print_table(rows)


if __name__ == "__main__":
    main()
