"""Where a decode step's time goes: the top CUDA kernels over 32 graph-replayed steps, what each
kernel adds to a step (end-to-end increments, which stay meaningful under PDL overlap), and one
layer's launches in order with their increments.

    python bench/profile_decode.py --shape qwen2.5-1.5b [--trace kernels.csv]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchd.engine.presets import preset  # noqa: E402
from batchd.engine.runtime import Engine, EngineConfig, build_model  # noqa: E402
from batchd.engine.types import GenerationRequest, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen2.5-1.5b")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--graphs", type=int, default=1)
    parser.add_argument("--trace", help="write every kernel (name, start us, duration us) to this CSV")
    args = parser.parse_args()
    config = preset(args.shape)
    engine = Engine(build_model(config, "cuda", torch.bfloat16), None, EngineConfig(max_context=args.context + 64,
                    cuda_graphs=bool(args.graphs)), eos_ids=set())
    prompt = list(range(args.context))
    request = GenerationRequest(sampling=SamplingParams(max_new_tokens=33, ignore_eos=True))
    engine.generate_ids(prompt, request)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = engine.generate_ids(prompt, request)
    print(f"{args.shape}: {out.decode_tokens_per_s:.0f} tok/s")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    busy = sum(e.time_range.elapsed_us() for e in kernels)
    span = kernels[-1].time_range.end - kernels[0].time_range.start if kernels else 0
    print(f"{len(kernels)} kernels, busy {busy / 1e3:.2f} ms of a {span / 1e3:.2f} ms span ({busy / max(span, 1):.0%})")
    print_increments(kernels[len(kernels) // 2:], steps=len(out.token_ids) // 2)
    print_layer_increments([(e.name, e.time_range.end) for e in kernels], config.num_layers)
    if args.trace:
        with open(args.trace, "w") as f:
            f.write("name,start_us,duration_us\n")
            for e in kernels:
                f.write(f"{e.name.replace(',', ';')[:90]},{e.time_range.start},{e.time_range.elapsed_us()}\n")


def print_increments(kernels, steps: int) -> None:
    """What each kernel adds to a step. Under programmatic dependent launch a kernel starts early
    and its duration includes its wait, so durations overlap; the time from the previous kernel's
    end to this one's end is what it costs the step. Per kernel name: launches per step, median
    and total increment per step (the second half of the run: steady decode steps)."""
    increments: dict[str, list[float]] = {}
    for before, kernel in zip(kernels, kernels[1:]):
        increments.setdefault(kernel.name[:48], []).append(kernel.time_range.end - before.time_range.end)
    print(f"{'kernel':48s} {'per step':>8s} {'median us':>9s} {'us/step':>8s}")
    for name, values in sorted(increments.items(), key=lambda kv: -sum(kv[1])):
        values.sort()
        print(f"{name:48s} {len(values) / max(steps, 1):8.1f} {values[len(values) // 2]:9.2f} "
              f"{sum(values) / max(steps, 1):8.1f}")


def print_layer_increments(kernels: list[tuple[str, float]], num_layers: int, first: str = "_step_inputs") -> None:
    """One layer's launches in order with what each adds to a step (median over the layers of
    the steady steps): kernels are (name, end us) in launch order; a step starts at `first`, and
    its layers are the run of launches that repeats num_layers times right after it."""
    starts = [i for i, (name, _) in enumerate(kernels) if name.startswith(first)]
    steps = [kernels[a:b] for a, b in zip(starts, starts[1:])][len(starts) // 2:]   # the steady half
    if not steps or num_layers < 2:
        print("no whole steps to split into layers")
        return
    names = [name for name, _ in steps[0]]
    period = next((k for k in range(1, (len(names) - 1) // num_layers + 1)
                   if all(names[1 + i] == names[1 + i + k] for i in range((num_layers - 1) * k))), None)
    if period is None:
        print("no launch pattern repeats once per layer")
        return
    increments = [[] for _ in range(period)]
    for step in steps:
        ends = [end for _, end in step]
        for i in range(1, 1 + num_layers * period):
            increments[(i - 1) % period].append(ends[i] - ends[i - 1])
    print(f"\none layer ({period} launches), median increment per launch (us):")
    for position, values in enumerate(increments):
        values.sort()
        print(f"  {position}: {names[1 + position][:44]:44s} {values[len(values) // 2]:6.2f}")
    print(f"  layer total {sum(sorted(v)[len(v) // 2] for v in increments):.1f} us")


if __name__ == "__main__":
    main()
