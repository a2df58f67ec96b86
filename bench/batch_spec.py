"""Draft-model speculation in the batch engine: documents per hour with it on and off, at batch
1, 8 and 64, on one GPU.

Random bf16 weights at a real shape (speed does not depend on weight values). The drafter is the
target's first --draft-layers layers with its final norm and head (`#layers=N`, sharing the
target's tensors). Random weights would make that drafter disagree with the target almost always,
which measures only what failed drafts cost; so the residual writes (o and down projections) of
the layers past the drafter's are scaled by --damp, and the drafter then agrees with the target
as a good drafter would. The acceptance each row measured is in the table; --damp 1 gives the
undamped model (a drafter that nearly never agrees).

Per batch size B: B documents of --prompt random tokens -> --new greedy tokens each (EOS
ignored), B in flight at a time (B = 1: --docs-at-1 documents one after another). Rows: plain
decoding; the drafter at the adaptive width (speculation turns itself off where it does not pay);
the drafter at fixed widths (--widths). Every row checks that its ids equal plain decoding's.

Run on the H200:  python bench/batch_spec.py
                  python bench/batch_spec.py --shape qwen2.5-1.5b --draft-layers 4 --batches 1 8 64
A CPU smoke run:  python bench/batch_spec.py --device cpu --shape smollm2-135m --prompt 64 --new 16 \
                      --batches 1 4 --docs-at-1 1 --widths 2
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table  # noqa: E402
from batchd.engine.batch import BatchOptions  # noqa: E402
from batchd.engine.generate import synchronize  # noqa: E402
from batchd.engine.presets import preset  # noqa: E402
from batchd.engine.runtime import Engine, EngineConfig, build_model  # noqa: E402
from batchd.engine.speculative import truncated_drafter  # noqa: E402
from batchd.engine.types import GenerationRequest, SamplingParams, SpeculationOptions  # noqa: E402

DRAFTER = "first-layers"


def damp_late_layers(model, first: int, factor: float) -> None:
    """Scale what layers `first`.. add to the residual stream, so that the first layers'
    prediction is close to the whole model's (weights only; the arithmetic is unchanged)."""
    with torch.no_grad():
        for layer in list(model.layers)[first:]:
            layer.self_attn.o_proj.weight.mul_(factor)
            layer.mlp.down_proj.weight.mul_(factor)


def run(batch, prompts: list[list[int]], new: int, spec: SpeculationOptions, in_flight: int):
    """`in_flight` documents at a time (one joins as one finishes) -> (seconds, ids, sequences)."""
    request = GenerationRequest(sampling=SamplingParams(max_new_tokens=new, ignore_eos=True), speculation=spec)
    waiting, seqs = list(prompts), []
    synchronize(batch.device)
    started = time.perf_counter()
    while waiting or batch.has_work:
        while waiting and sum(s.finish_reason is None for s in seqs) < in_flight:
            seqs.append(batch.submit(waiting.pop(0), request))
        batch.step()
    synchronize(batch.device)
    return time.perf_counter() - started, [s.generated for s in seqs], seqs


def spec_row(batch_size: int, name: str, seconds: float, ids, seqs, plain_ids, docs: int) -> dict:
    offered, accepted, steps = (sum(getattr(s, f) for s in seqs) for f in ("spec_offered", "spec_accepted", "spec_steps"))
    return {"batch": batch_size, "spec": name, "docs": docs, "seconds": seconds, "docs/hour": docs / seconds * 3600,
            "out tok/s": sum(map(len, ids)) / seconds, "acceptance": accepted / offered if offered else None,
            "tokens/verify": (accepted + steps) / steps if steps else None, "same ids": ids == plain_ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3-8b")
    parser.add_argument("--draft-layers", type=int, default=4)
    parser.add_argument("--damp", type=float, default=0.05, help="scale of the later layers' residual writes")
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--docs-at-1", type=int, default=2, help="documents timed at batch 1")
    parser.add_argument("--widths", type=int, nargs="*", default=[4])
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (tiny --shape, short prompts)")
    args = parser.parse_args()
    config = preset(args.shape)
    cuda = args.device == "cuda"
    if not cuda and config.hidden_size > 2048:
        parser.error(f"--shape {args.shape} is too large for a CPU smoke run: pass a tiny one (--shape smollm2-135m)")
    model = build_model(config, args.device, torch.bfloat16 if cuda else torch.float32, seed=0)
    damp_late_layers(model, args.draft_layers, args.damp)
    rng = random.Random(0)
    docs = max(args.batches + [args.docs_at_1])
    prompts = [[rng.randrange(config.vocab_size) for _ in range(args.prompt)] for _ in range(docs)]
    engine = Engine(model, None, EngineConfig(max_context=args.prompt + args.new + 64), eos_ids=set())
    engine.drafters.register(DRAFTER, truncated_drafter(engine.drafters.target, args.draft_layers))
    chunk = min(4096, -(-args.prompt // 64) * 64)
    batch = engine.batch_engine(BatchOptions(block_size=64 if cuda else 16, prefill_chunk=chunk, drafters=(DRAFTER,),
                                             max_blocks=None if cuda else 64 * docs))
    specs = [("off", SpeculationOptions())]
    specs.append(("draft adaptive", SpeculationOptions("draft", drafter_path=DRAFTER)))
    specs += [(f"draft w{w}", SpeculationOptions("draft", drafter_path=DRAFTER, width=w)) for w in args.widths]
    # warm-up: compile, autotune and capture the row graphs of every spec up to the largest batch
    # (prompts of their own, so that no timed chunk is in the prefix cache)
    warm = [[rng.randrange(config.vocab_size) for _ in range(args.prompt if i < 2 else min(300, args.prompt))]
            for i in range(max(2, max(args.batches)))]
    for _, spec in specs:
        run(batch, warm, 16, spec, max(args.batches))
    rows = []
    for batch_size in args.batches:
        n = args.docs_at_1 if batch_size == 1 else batch_size
        plain_ids = None
        for name, spec in specs:
            seconds, ids, seqs = run(batch, prompts[:n], args.new, spec, batch_size)
            plain_ids = ids if plain_ids is None else plain_ids
            rows.append(spec_row(batch_size, name, seconds, ids, seqs, plain_ids, n))
            print(rows[-1], flush=True)
    print(f"\n{args.shape}, drafter: its first {args.draft_layers} layers (later layers' residual writes x{args.damp}), "
          f"{args.prompt} -> {args.new} tokens, greedy")
    print_table(rows)


if __name__ == "__main__":
    main()
