"""Speculative decoding: what a verify step costs, and what speculation buys end to end.

CPU (default): the real SmolLM2-135M GGUF in float32 summarising aclsum papers. Per method
(plain decode, prompt lookup adaptive and at fixed widths, interleaved per paper): decode
tokens/s, speed-up over plain in the same run (overall, its range over the papers, and as
modelled from step counts and the measured verify/decode cost ratios),
acceptance rate, mean accepted length (bonus token included), whether speculation switched itself
off; the greedy outputs are checked to be identical. Then the cost of one verify step of q + 1
rows over a one-token decode step at the prompt's context.

    python bench/speculative.py                      # CPU, 4 papers, 128 new tokens
    python bench/speculative.py --papers 3 --new-tokens 64

GPU (`--device cuda`): random weights at the Qwen2.5-1.5B and Llama-3-8B shapes (speed does not
depend on weight values), bf16, CUDA graphs. Per shape: verify-step time for q = 1, 2, 4, 8, 16
over the one-token decode step at 1K context, and end-to-end decode tokens/s of self-drafting (the
target drafts for itself: acceptance 1.0, the upper bound of the machinery's own cost) at q = 4
and 8 over plain decode. One table.

    python bench/speculative.py --device cuda
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import cuda_time, print_table  # noqa: E402
from batchd.engine.generate import synchronize  # noqa: E402
from batchd.engine.runtime import Engine, EngineConfig  # noqa: E402
from batchd.engine.sampling import Sampler  # noqa: E402
from batchd.engine.speculative import Proposal, self_drafter, verify_step  # noqa: E402
from batchd.engine.types import GenerationRequest, SamplingParams, SpeculationOptions, Telemetry  # noqa: E402

VERIFY_WIDTHS = (1, 2, 4, 8, 16)


def verify_seconds(engine: Engine, q: int, repeats: int) -> float:
    """Median seconds of one greedy step at the cache's current length: a plain decode step for
    q = 0, else a verify step of q drafts (q + 1 rows) as the speculative loop runs it, decision
    included; the rows are rolled back after each step."""
    cache, sampler = engine.cache, Sampler(SamplingParams(), engine.device)
    base = cache.length
    drafts = Proposal(torch.randint(0, engine.config.vocab_size, (q,), device=engine.device))
    times = []
    for i in range(repeats + 2):
        synchronize(engine.device)
        started = time.perf_counter()
        verify_step(engine.runner, sampler, 7, drafts)
        synchronize(engine.device)
        if i >= 2:  # warm-up: graph capture, allocator
            times.append(time.perf_counter() - started)
        cache.truncate(base)
    return statistics.median(times)


def forward_seconds_cuda(engine: Engine, rows: int, repeats: int) -> float:
    """Median GPU seconds (CUDA events) of the target's step over `rows` tokens: the forward alone,
    graph-replayed up to 16 rows; the rows are rolled back after each step."""
    cache, base = engine.cache, engine.cache.length
    tokens = torch.randint(0, engine.config.vocab_size, (1, rows), device=engine.device)

    def step():
        engine.runner.step(tokens)
        cache.truncate(base)

    return cuda_time(step, warmup=3, repeats=repeats)


def verify_costs(engine: Engine, prompt: list[int], repeats: int) -> dict[int, float]:
    """{q: verify step seconds / decode step seconds} at len(prompt) context; [0]: decode seconds.
    On CUDA the target's forward alone (GPU time); on the CPU the whole greedy step as the loop
    runs it (the head's certified argmax included)."""
    engine.cache.reset()
    with torch.inference_mode():
        engine.runner.prefill(torch.tensor([prompt], device=engine.device), engine.prefill_chunk)
        if engine.device.type == "cuda":
            seconds = {q: forward_seconds_cuda(engine, q + 1, repeats) for q in (0, *VERIFY_WIDTHS)}
        else:
            seconds = {q: verify_seconds(engine, q, repeats) for q in (0, *VERIFY_WIDTHS)}
    engine.cache.reset()
    return {q: seconds[0] if q == 0 else seconds[q] / seconds[0] for q in seconds}


def run(engine: Engine, prompt_ids: list[int], spec: SpeculationOptions, new_tokens: int):
    telemetry = Telemetry()
    request = GenerationRequest(sampling=SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), speculation=spec)
    out = engine.generate_ids(prompt_ids, request, telemetry)
    return out, telemetry


# ---- CPU: SmolLM2 on aclsum ---------------------------------------------------------------------

def summary_prompt(paper, chars: int) -> str:
    return f"Summarise the paper below in three sentences.\n\n{paper.title}\n\n{paper.abstract}\n\n{paper.body[:chars]}"


def bench_cpu(args) -> None:
    from batchd.samples import aclsum_papers
    from tests.conftest import smollm2_gguf_path

    engine = Engine.load(str(smollm2_gguf_path()), EngineConfig(device="cpu", dtype="float32", max_context=4096))
    engine.warm_up()  # packs the weights for the small-step path (engine.linear) before any timing
    methods = {"plain": SpeculationOptions(), "lookup adaptive": SpeculationOptions("lookup")}
    methods.update({f"lookup q={w}": SpeculationOptions("lookup", width=w) for w in args.widths})
    totals = {name: dict(jobs=0, tokens=0, seconds=0.0, offered=0, accepted=0, steps=0, disabled=0) for name in methods}
    speedups = {name: [] for name in methods}  # per paper, over plain on the same paper
    load_before = os.getloadavg()
    prompts = []
    for paper in aclsum_papers(limit=args.papers):
        ids = engine.codec.encode_request(summary_prompt(paper, args.chars), None, True)
        prompts.append(ids)
        outputs, seconds = {}, {}
        for name, spec in methods.items():  # interleaved per paper: the machine's load hits all alike
            out, t = run(engine, ids, spec, args.new_tokens)
            outputs[name], seconds[name] = out.token_ids, out.decode_s
            row = totals[name]
            row["jobs"] += 1
            row["tokens"] += len(out.token_ids)
            row["seconds"] += out.decode_s
            row["offered"] += t.spec_draft_tokens_offered
            row["accepted"] += t.spec_draft_tokens_accepted
            row["steps"] += t.spec_steps
            row["disabled"] += t.spec_disabled
        same = all(ids_ == outputs["plain"] for ids_ in outputs.values())
        rates = ", ".join(f"{name} {len(outputs[name]) / seconds[name]:.1f}" for name in methods)
        for name in methods:
            speedups[name].append(seconds["plain"] / seconds[name] * len(outputs[name]) / len(outputs["plain"]))
        print(f"{paper.paper_id}: {len(ids)} prompt tokens, outputs identical: {same}; tok/s {rates}", flush=True)
    costs = verify_costs(engine, prompts[0], repeats=args.repeats)
    plain_rate = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    rows = []
    for name, r in totals.items():
        rate = r["tokens"] / r["seconds"]
        rows.append({"method": name, "decode tok/s": rate, "vs plain": rate / plain_rate,
                     "per paper": f"{min(speedups[name]):.2f}-{max(speedups[name]):.2f}",
                     "modelled": modelled_speedup(r, costs),
                     "acceptance": r["accepted"] / r["offered"] if r["offered"] else None,
                     "mean accepted len": (r["accepted"] + r["steps"]) / r["steps"] if r["steps"] else None,
                     "spec steps": r["steps"], "switched off": f"{r['disabled']}/{args.papers}"})
    print(f"\nSmolLM2-135M fp32 on CPU ({torch.get_num_threads()} threads), {args.papers} aclsum summaries, "
          f"{args.new_tokens} new tokens each, greedy; load average {load_before[0]:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after (1 min)")
    print_table(rows)
    print(f"\nverify step (q + 1 rows) / decode step at {len(prompts[0])} tokens of context "
          f"(decode step {costs[0] * 1e3:.1f} ms)")
    print_table([{f"q={q}": costs[q] for q in VERIFY_WIDTHS}])


def modelled_speedup(totals: dict, costs: dict[int, float]) -> float:
    """Plain decode steps saved, from step counts and the measured verify/decode cost ratios (less
    sensitive to a shared machine's load than tokens/s): the tokens over the decode-step
    equivalents spent, each speculative step costed at its mean width (interpolated), every other
    token a plain step. Each job's first token comes from the prefill, as in plain decoding."""
    steps = totals["steps"]
    if not steps:
        return 1.0
    decode_tokens = totals["tokens"] - totals["jobs"]
    spec_tokens = totals["accepted"] + steps
    widths = sorted(q for q in costs if q)
    mean_width = totals["offered"] / steps
    step_cost = float(np.interp(mean_width, [0, *widths], [1.0, *(costs[q] for q in widths)]))
    return decode_tokens / (steps * step_cost + decode_tokens - spec_tokens)


# ---- GPU: random weights at real shapes -------------------------------------------------------

def bench_cuda(args, device: str = "cuda") -> None:
    from batchd.engine.presets import preset

    rows = []
    for shape in args.shapes:
        engine = Engine.from_config(preset(shape), EngineConfig(device=device,
                                    dtype="bf16" if device == "cuda" else "fp32", max_context=args.context + 1024))
        engine.drafters.register("self", self_drafter(engine.drafters.target))
        prompt = torch.randint(0, engine.config.vocab_size, (args.context,),
                               generator=torch.Generator().manual_seed(0)).tolist()
        costs = verify_costs(engine, prompt, repeats=args.repeats)
        row = {"shape": shape, "decode ms": costs[0] * 1e3}
        row.update({f"verify q={q} / decode": costs[q] for q in VERIFY_WIDTHS})
        plain_rate = None
        for name, spec in [("plain", SpeculationOptions())] + [
                (f"self q={q}", SpeculationOptions("draft", drafter_path="self", width=q)) for q in (4, 8)]:
            run(engine, prompt, spec, 32)  # warm-up: graphs of every width
            out, t = run(engine, prompt, spec, args.new_tokens)
            rate = out.decode_tokens_per_s
            if plain_rate is None:
                plain_rate, plain_ids = rate, out.token_ids
                row["plain tok/s"] = rate
                continue
            row[f"{name} tok/s"] = rate
            row[f"{name} / plain"] = rate / plain_rate
            row[f"{name} acc"] = t.acceptance_rate
            row[f"{name} same ids"] = out.token_ids == plain_ids
        rows.append(row)
        engine.close()
        del engine
    print(f"\nrandom weights, bf16, CUDA graphs, {args.context}-token context, {args.new_tokens} new tokens; "
          "verify q=16 is 17 rows: a graph of its own, attention as 16 lanes then 1")
    # one row per shape is wide; print it transposed
    print_table([{"metric": key, **{r["shape"]: r.get(key) for r in rows}} for key in rows[0] if key != "shape"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--papers", type=int, default=4)
    parser.add_argument("--chars", type=int, default=3000, help="paper body characters in each prompt (CPU)")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--widths", type=int, nargs="*", default=[4, 8], help="fixed lookup widths (CPU)")
    parser.add_argument("--shapes", nargs="*", default=["qwen2.5-1.5b", "llama-3-8b"])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        args.new_tokens, args.repeats = args.new_tokens or 256, args.repeats or 50
        bench_cuda(args)
    else:
        args.new_tokens, args.repeats = args.new_tokens or 128, args.repeats or 5
        bench_cpu(args)


if __name__ == "__main__":
    main()
