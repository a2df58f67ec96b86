"""Documents per hour on one GPU: the batch engine against one job at a time, HF transformers'
static batched `generate`, and the floor from ceilings measured in the same run.

Random weights at a real model's shape (speed does not depend on weight values); HF holds the very
same tensors. Greedy, EOS ignored. Workloads:
  overnight: --docs documents of --prompt tokens -> --new tokens each (default 64 x 4096 -> 256)
  mixed:     --mixed-docs documents, prompts uniform in 1K-16K tokens, outputs uniform in 128-512

Rows: batchd batched (the default, batch-invariant); batchd batched with batch-dependent
projections (one GEMM over every row: the cost of invariance); batchd one job at a time (the engine
a worker ran before batching, timed on --single-docs documents); HF static batch; the floor =
prefill FLOPs / measured bf16 matmul rate + decode bytes (weights once a step, every sequence's KV)
/ measured copy bandwidth.

Run on the H200:  python bench/throughput.py
                  python bench/throughput.py --v4-layers 4 --docs 16   (the V4 batch engine, V4-Flash sizes)
                  python bench/throughput.py --shape qwen2.5-1.5b --docs 16 --no-hf --mixed-docs 0
"""
from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import copy_bandwidth, print_table  # noqa: E402
from bench.v4_shapes import layer_count  # noqa: E402
from bench.decode import kv_bytes_per_token, reference_model, weight_bytes_per_token  # noqa: E402
from batchd.engine.batch import BatchOptions  # noqa: E402
from batchd.engine.presets import preset  # noqa: E402
from batchd.engine.runtime import Engine, EngineConfig, build_model  # noqa: E402
from batchd.engine.types import GenerationRequest, SamplingParams  # noqa: E402


def matmul_rate(n: int = 8192, repeats: int = 20) -> float:
    """bf16 FLOP/s of a square GEMM (the prefill ceiling)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def floor_seconds(model, config, prompts: list[int], outputs: list[int], flops: float, bandwidth: float) -> float:
    """Prefill FLOPs (weights and causal attention) at the matmul ceiling, plus every decode step's
    bytes (the weights once, each live sequence's KV) at the copy ceiling."""
    weights = weight_bytes_per_token(model)
    params = weights / 2
    attn = 2 * config.num_layers * config.num_heads * config.head_dim
    prefill = sum(2 * params * p + attn * p * p for p in prompts)
    decode_bytes = 0.0
    for step in range(max(outputs)):
        live = [p + step for p, o in zip(prompts, outputs) if step < o]
        decode_bytes += weights + sum(kv_bytes_per_token(config, n) for n in live)
    return prefill / flops + decode_bytes / bandwidth


def run_batched(engine: Engine, prompts: list[list[int]], outputs: list[int], options: BatchOptions,
                phases: dict | None = None):
    """-> (seconds, generated ids per document, steps). With `phases`: each step is synchronised and
    its seconds added to phases["prefill"] (steps with prompt chunks) or phases["decode"]."""
    batch = engine.batch_engine(options)
    seqs = [batch.submit(p, GenerationRequest(sampling=SamplingParams(max_new_tokens=o, ignore_eos=True)))
            for p, o in zip(prompts, outputs)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    while batch.has_work:
        began = time.perf_counter()
        batch.step()
        if phases is not None:
            torch.cuda.synchronize()
            kind = "prefill" if batch.last_plan.chunks else "decode"
            phases[kind] = phases.get(kind, 0.0) + time.perf_counter() - began
            phases[kind + " steps"] = phases.get(kind + " steps", 0) + 1
    torch.cuda.synchronize()
    return time.perf_counter() - start, [s.generated for s in seqs], batch.steps


def run_single(engine: Engine, prompts: list[list[int]], outputs: list[int]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for p, o in zip(prompts, outputs):
        engine.generate_ids(p, GenerationRequest(sampling=SamplingParams(max_new_tokens=o, ignore_eos=True)))
    torch.cuda.synchronize()
    return time.perf_counter() - start


@torch.no_grad()
def run_hf(hf, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts, device="cuda")
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    hf.generate(ids[:2, :64], max_new_tokens=4, min_new_tokens=4, **kwargs)   # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def row(system: str, docs: int, seconds: float, tokens: int, floor: float, **extra) -> dict:
    return {"system": system, "docs": docs, "seconds": seconds, "docs/hour": docs / seconds * 3600,
            "out tok/s": tokens / seconds, "of floor": floor / seconds, **extra}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3-8b")
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--single-docs", type=int, default=8, help="documents timed one at a time")
    parser.add_argument("--mixed-docs", type=int, default=64)
    parser.add_argument("--no-hf", dest="hf", action="store_false")
    parser.add_argument("--no-dependent", dest="dependent", action="store_false",
                        help="skip the batch-dependent variant")
    parser.add_argument("--chunk", type=int, default=4096, help="prefill chunk (tokens)")
    parser.add_argument("--step-tokens", type=int, default=8192, help="prompt tokens a step")
    parser.add_argument("--slab", type=int, default=BatchOptions.slab_rows, help="rows of every decode projection")
    parser.add_argument("--no-stepwise", dest="stepwise", action="store_false",
                        help="skip the row that reads every step back before planning the next (launch_ahead off)")
    parser.add_argument("--phases", action="store_true", help="also time prefill and decode steps apart (synchronised)")
    parser.add_argument("--only-batched", action="store_true", help="the batched rows only (tuning runs)")
    parser.add_argument("--v4-layers", type=layer_count, default=0,
                        help="instead: the V4 batch engine on a DeepSeek V4-Flash-shaped model of N layers "
                             "('fit': as many as the GPU holds)")
    parser.add_argument("--v4-smoke", action="store_true", help="with --v4-layers: tiny sizes on the CPU")
    args = parser.parse_args()
    if args.v4_layers:
        from bench.v4_decode import bench_v4_batch

        return print_table([bench_v4_batch(args.v4_layers, args.docs, args.prompt, args.new, args.v4_smoke,
                                           phases=args.phases)])
    torch.manual_seed(0)
    bandwidth, flops = copy_bandwidth(), matmul_rate()
    print(f"copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s", flush=True)
    config = preset(args.shape)
    hf = reference_model(config) if args.hf else None
    tensors = dict(hf.state_dict()) if hf is not None else None
    model = build_model(config, "cuda", torch.bfloat16, tensors=tensors)
    rng = random.Random(0)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(args.prompt)] for _ in range(args.docs)]
    outputs = [args.new] * args.docs
    max_context = max(args.prompt + args.new, 16384 + 512 if args.mixed_docs else 0) + 64
    engine = Engine(model, None, EngineConfig(max_context=max_context), eos_ids=set())
    options = BatchOptions(block_size=64, max_step_tokens=args.step_tokens, slab_rows=args.slab, prefill_chunk=args.chunk)
    floor = floor_seconds(model, config, [args.prompt] * args.docs, outputs, flops, bandwidth)
    rows = []
    # warm-up: compile, autotune and pick GEMM kernels for every shape the runs take (prompts of
    # their own, so that no chunk of the timed prompts is in the prefix cache)
    warm = [[rng.randrange(config.vocab_size) for _ in range(n)] for n in (args.prompt, args.prompt, 300)]
    run_batched(engine, warm, [8, 8, 8], options)
    seconds, ids, steps = run_batched(engine, prompts, outputs, options)
    rows.append(row("batchd batched (invariant)", args.docs, seconds, sum(map(len, ids)), floor, steps=steps))
    print(rows[-1], flush=True)
    if args.stepwise:   # what launching greedy steps ahead gains, in the same run
        stepwise = replace(options, launch_ahead=False)
        sw_seconds, sw_ids, steps = run_batched(engine, prompts, outputs, stepwise)
        rows.append(row("batchd batched, every step read back first", args.docs, sw_seconds, sum(map(len, sw_ids)),
                        floor, steps=steps, **{"launch-ahead gain": sw_seconds / seconds - 1,
                                               "same ids": sw_ids == ids}))
        print(rows[-1], flush=True)
    if args.phases:
        phases: dict = {}
        run_batched(engine, prompts, outputs, options, phases)
        print("phases (synchronised steps):", {k: round(v, 3) for k, v in phases.items()}, flush=True)
    if args.only_batched:
        print_table(rows)
        return
    _, alone, _ = run_batched(engine, prompts[:1], outputs[:1], options)
    _, last_alone, _ = run_batched(engine, prompts[-1:], outputs[-1:], options)
    same = alone[0] == ids[0] and last_alone[0] == ids[-1]
    print(f"first and last document alone give the same ids as in the batch: {same}", flush=True)
    if args.dependent:
        dependent = BatchOptions(block_size=64, max_step_tokens=args.step_tokens, slab_rows=args.slab,
                                 prefill_chunk=args.chunk, batch_invariant=False)
        run_batched(engine, warm, [8, 8, 8], dependent)
        dep_seconds, dep_ids, steps = run_batched(engine, prompts, outputs, dependent)
        rows.append(row("batchd batched (batch-dependent GEMM)", args.docs, dep_seconds, sum(map(len, dep_ids)), floor,
                        steps=steps, **{"invariance cost": seconds / dep_seconds - 1}))
        print(rows[-1], flush=True)
    engine.release_batch_engine()   # its pool would leave HF no room
    gc.collect()
    torch.cuda.empty_cache()
    if args.single_docs:
        n = args.single_docs
        engine.generate_ids(prompts[0][:300], GenerationRequest(sampling=SamplingParams(max_new_tokens=8, ignore_eos=True)))
        single = run_single(engine, prompts[:n], outputs[:n])
        rows.append(row(f"batchd one job at a time ({n} docs timed)", n, single, n * args.new,
                        floor_seconds(model, config, [args.prompt] * n, outputs[:n], flops, bandwidth)))
        print(rows[-1], flush=True)
    if hf is not None:
        hf_seconds = run_hf(hf, prompts, args.new)
        rows.append(row(f"HF generate, static batch {args.docs}", args.docs, hf_seconds, args.docs * args.new, floor))
        print(rows[-1], flush=True)
        del hf, tensors
        gc.collect()
        torch.cuda.empty_cache()
    rows.append({"system": "floor (measured ceilings)", "docs": args.docs, "seconds": floor,
                 "docs/hour": args.docs / floor * 3600, "out tok/s": args.docs * args.new / floor, "of floor": 1.0})
    if args.mixed_docs:
        m_prompts = [rng.randrange(1024, 16385) for _ in range(args.mixed_docs)]
        m_outputs = [rng.randrange(128, 513) for _ in range(args.mixed_docs)]
        m_ids = [[rng.randrange(config.vocab_size) for _ in range(n)] for n in m_prompts]
        m_floor = floor_seconds(model, config, m_prompts, m_outputs, flops, bandwidth)
        seconds, ids, steps = run_batched(engine, m_ids, m_outputs, options)
        rows.append(row("mixed: batchd batched", args.mixed_docs, seconds, sum(map(len, ids)), m_floor, steps=steps))
        rows.append({"system": "mixed: floor", "docs": args.mixed_docs, "seconds": m_floor,
                     "docs/hour": args.mixed_docs / m_floor * 3600, "out tok/s": sum(m_outputs) / m_floor,
                     "of floor": 1.0})
    print_table(rows)


if __name__ == "__main__":
    main()
