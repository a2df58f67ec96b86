"""kernels.stream_linear against kernels.small_matmul's Triton tiles and cuBLAS, on the H200.

1. Checks, per decode projection of Qwen2.5-1.5B and Llama-3-8B: the kernel against the float32
   reference (small_linear_reference) at M = 1, 3 and 17, and batch invariance (the rows of an
   M = 17 call equal one-row calls bit for bit).
2. Each projection alone: a CUDA graph of calls over enough weight copies that nothing stays in
   the L2 (programmatic dependent launch on, as in a decode step), us per call and the weight's
   bytes over it, against the copy bandwidth measured in the same run.

    python bench/stream_linear.py [--rings 192:1,96:2] [--shapes qwen2.5-1.5b,llama-3-8b]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import copy_bandwidth, graph_replay_time, print_table  # noqa: E402
from batchd.kernels.small_matmul import small_linear  # noqa: E402
from batchd.kernels.small_matmul.reference import small_linear_reference  # noqa: E402
from batchd.kernels.stream_linear import stream_linear  # noqa: E402

# name -> [(projection, N, K, fusion)]; fusion: "plain", "bias", "gated" (norm folded in), "residual"
# (residual + emitted norm inputs), as the decode layer calls them
SHAPES = {
    "qwen2.5-1.5b": [("qkv", 2048, 1536, "bias"), ("o", 1536, 1536, "plain"), ("gate_up", 8960, 1536, "gated"),
                     ("down", 1536, 8960, "residual"), ("lm_head", 151936, 1536, "plain")],
    "llama-3-8b": [("gate_up", 14336, 4096, "gated"), ("down", 4096, 14336, "residual"),
                   ("lm_head", 128256, 4096, "plain")],
}


def make_call(N: int, K: int, fusion: str, M: int, gen: torch.Generator, copies: int = 1):
    """Weights (copies of them) and inputs for one projection -> (list of weights, kwargs builder)."""
    dev, dt = "cuda", torch.bfloat16
    rows = 2 * N if fusion == "gated" else N
    weights = [(torch.randn(rows, K, generator=gen, device=dev) * K**-0.5).to(dt) for _ in range(copies)]
    x = torch.randn(M, K, generator=gen, device=dev).to(dt)
    kwargs = {}
    if fusion == "bias":
        kwargs["bias"] = torch.randn(N, generator=gen, device=dev).to(dt)
    if fusion == "gated":
        kwargs.update(gated=True, row_sumsq=torch.rand(3, M, generator=gen, device=dev) * K, eps=1e-6)
    if fusion == "residual":
        kwargs.update(residual=torch.randn(M, N, generator=gen, device=dev).to(dt),
                      emit_norm_weight=torch.randn(N, generator=gen, device=dev).to(dt))
    return weights, x, kwargs


def first(result):
    return result[0] if isinstance(result, tuple) else result


def checks(shapes) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for model, name, N, K, fusion in shapes:
        (weight,), x, kwargs = make_call(N, K, fusion, 17, gen)
        full = stream_linear(x, weight, **kwargs)
        ref = small_linear_reference(x, weight, **kwargs)
        errors = []
        for M in (1, 3, 17):
            sub = {k: (v[:M] if k == "residual" else v[:, :M].contiguous() if k == "row_sumsq" else v) for k, v in kwargs.items()}
            out = first(stream_linear(x[:M], weight, **sub))
            diff = (out.float() - first(ref)[:M].float()).abs().max().item()
            errors.append(diff / first(ref)[:M].float().abs().max().item())
        alone = torch.cat([first(stream_linear(x[m:m + 1], weight, **{
            k: (v[m:m + 1] if k == "residual" else v[:, m:m + 1].contiguous() if k == "row_sumsq" else v)
            for k, v in kwargs.items()})) for m in range(17)])
        invariant = torch.equal(alone, first(full))
        if fusion == "residual":  # the emitted norm inputs: weighted rows, and the parts' sums
            weighted_err = (full[1].weighted.float() - ref[1].weighted.float()).abs().max().item()
            sumsq_err = ((full[1].sumsq.sum(0) - ref[1].sumsq.sum(0)).abs() / ref[1].sumsq.sum(0)).max().item()
        else:
            weighted_err = sumsq_err = float("nan")
        rows.append({"shape": model, "weight": name, "fusion": fusion,
                     "rel err M=1/3/17": "/".join(f"{e:.1e}" for e in errors),
                     "rows invariant": invariant, "emit err w/sumsq": f"{weighted_err:.1e}/{sumsq_err:.1e}"})
    return rows


def timings(shapes, rings: list[tuple[int, int]], bandwidth: float) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for model, name, N, K, fusion in shapes:
        weight_bytes = (2 * N if fusion == "gated" else N) * K * 2
        copies = max(2, -(-600_000_000 // weight_bytes))    # > 10x the L2 per replay
        weights, x, kwargs = make_call(N, K, fusion, 1, gen, copies)

        def chain(op):
            return lambda: [op(x, w, **kwargs) for w in weights]

        variants = [("triton table", chain(small_linear))]
        variants += [(f"stream ring {kb} KB x {ctas}", chain(lambda x_, w_, kb=kb, ctas=ctas, **kw: stream_linear(
            x_, w_, ring_bytes=kb * 1024, ctas_per_sm=ctas, **kw))) for kb, ctas in rings]
        if fusion in ("plain", "bias"):
            variants.append(("cuBLAS F.linear", chain(lambda x_, w_, **kw: F.linear(x_, w_, kw.get("bias")))))
        for label, fn in variants:
            seconds = graph_replay_time(fn) / copies
            rows.append({"shape": model, "weight": f"{name} {N}x{K}", "kernel": label, "us": round(seconds * 1e6, 2),
                         "TB/s": round(weight_bytes / seconds / 1e12, 2),
                         "of copy bw": round(weight_bytes / seconds / bandwidth, 3)})
        del weights
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen2.5-1.5b,llama-3-8b")
    parser.add_argument("--rings", default="192:1,96:1,96:2,64:2", help="ring KB:CTAs per SM, comma-separated")
    parser.add_argument("--skip-checks", action="store_true")
    args = parser.parse_args()
    shapes = [(model, *entry) for model in args.shapes.split(",") for entry in SHAPES[model]]
    if not args.skip_checks:
        print_table(checks(shapes))
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    rings = [tuple(int(v) for v in item.split(":")) for item in args.rings.split(",")]
    print_table(timings(shapes, rings, bandwidth))


if __name__ == "__main__":
    main()
