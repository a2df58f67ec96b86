"""Where a V4 decode step's time goes (issue 37): the step's wall time, its GPU-busy time and kernel
launches, and each part's share of the wall time (synchronised around every module of a kind, so
a part's figure is its own launches and host work; inclusive: an Attention holds its Compressor).

    python bench/v4_profile.py --layers 4                    # V4-Flash layer shapes, bf16, H200
    python bench/v4_profile.py --layers 4 --sequences 16     # a V4 batch engine step of 16 decoding sequences
    python bench/v4_profile.py --device cpu --smoke --layers 3
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.v4_shapes import random_v4_model, v4_config  # noqa: E402
from batchd.engine.generate import synchronize  # noqa: E402

PARTS = ("HyperConnection", "HyperHead", "Attention", "Compressor", "Indexer", "MoE", "Router", "Experts",
         "SharedExpert", "RMSNorm", "RowLinear", "GroupedLinear")


def part_times(model, step, device) -> dict[str, float]:
    """Wall seconds per module kind over one call of `step`, each module synchronised on entry and exit."""
    seconds: dict[str, float] = collections.defaultdict(float)
    started: dict[int, float] = {}
    hooks = []

    def enter(module, _inputs):
        synchronize(device)
        started[id(module)] = time.perf_counter()

    def leave(module, _inputs, _output):
        synchronize(device)
        seconds[type(module).__name__] += time.perf_counter() - started.pop(id(module))

    for module in model.modules():
        if type(module).__name__ in PARTS:
            hooks += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        step()
    finally:
        for hook in hooks:
            hook.remove()
    return seconds


def model_step(model, args):
    """One greedy sequence after a prompt of args.prompt tokens: -> its decode step."""
    cache = model.new_cache(args.prompt + 3 * args.steps + 8)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    token = model(prompt.to(model.device), cache, last_only=True)[0, -1].argmax().view(1, 1)

    def step():
        nonlocal token
        token = model(token, cache)[0, -1].argmax().view(1, 1)
    return step


def batch_step(model, args):
    """args.sequences prompts in a V4BatchEngine, stepped until every one decodes: -> a step of it."""
    from batchd.engine.deepseek_v4.batch import V4BatchEngine
    from batchd.engine.types import GenerationRequest, SamplingParams

    new = 3 * args.steps + 8
    batch = V4BatchEngine(model, max_context=args.prompt + new + 64, eos_ids=set(), block_size=16 if args.smoke else 64,
                          chunk=128 if args.smoke else 512, max_running=args.sequences)
    generator = torch.Generator().manual_seed(0)
    seqs = [batch.submit(torch.randint(0, model.config.vocab_size, (args.prompt,), generator=generator).tolist(),
                         GenerationRequest(sampling=SamplingParams(max_new_tokens=new, ignore_eos=True)))
            for _ in range(args.sequences)]
    while not all(seq.generated for seq in seqs):
        batch.step()
    return batch.step


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="the tests' tiny sizes (CPU)")
    parser.add_argument("--sequences", type=int, default=0,
                        help="profile a V4 batch engine step of this many decoding sequences (0: the model at batch 1)")
    args = parser.parse_args()
    device = torch.device(args.device)
    config = v4_config(args.layers, tiny=args.smoke)
    model = random_v4_model(config, device, torch.float32 if args.smoke else torch.bfloat16)
    step = batch_step(model, args) if args.sequences else model_step(model, args)

    for _ in range(3):
        step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    synchronize(device)
    step_ms = (time.perf_counter() - start) / args.steps * 1e3

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        synchronize(device)
    events = prof.key_averages()
    aten_calls = sum(e.count for e in events if e.key.startswith("aten::"))
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_ms = sum(e.device_time for e in kernels) / 1e3 if kernels else float("nan")

    parts = part_times(model, step, device)
    who = f"{args.sequences} sequences in the batch engine" if args.sequences else "batch 1"
    print(f"V4 {'tiny' if args.smoke else 'V4-Flash shapes'} x{args.layers} layers, {device.type}, {who}, "
          f"context {args.prompt}: decode step {step_ms:.2f} ms, GPU busy {busy_ms:.2f} ms, "
          f"{len(kernels)} kernels, {aten_calls} aten calls")
    print(f"{'part (inclusive, synchronised)':32s} {'ms a step':>10s} {'ms a layer':>10s}")
    for name, secs in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"{name:32s} {secs * 1e3:10.2f} {secs * 1e3 / args.layers:10.2f}")
    print("top aten calls by count:", ", ".join(f"{e.key[6:]} {e.count}" for e in
                                               sorted(events, key=lambda e: -e.count)[:12] if e.key.startswith("aten::")))


if __name__ == "__main__":
    main()
