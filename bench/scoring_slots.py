"""PFlash's padded scoring with 1, 2, 4 or 8 prompts a forward (PaddedScorer's slots), alone on the GPU.

A Qwen2.5-0.5B-shape drafter in bf16 with random weights (speed does not depend on their values)
scores --prompts random prompts of --tokens tokens, all of one padded length, through its CUDA
graphs. Rows per slot count: milliseconds of wall time a prompt when all wait together
(synchronised around the whole `score_many`, `.cpu()` included, as the compressor reads them),
and the latency of one prompt scored alone (which pays for the empty slots); whether one
prompt's scores had the same bits alone, in the last slot and among all the others.

    python bench/scoring_slots.py                         # H200: slots 1, 2, 4, 8
    python bench/scoring_slots.py --device cpu --shape smollm2-135m --tokens 300 --prompts 4 --slots 1,2
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table  # noqa: E402
from batchd.engine.generate import synchronize  # noqa: E402
from batchd.engine.model import build_model  # noqa: E402
from batchd.engine.pflash.scoring import PaddedScorer  # noqa: E402
from batchd.engine.presets import preset  # noqa: E402


def timed(device, work) -> tuple[float, list]:
    synchronize(device)
    started = time.perf_counter()
    out = work()
    synchronize(device)
    return time.perf_counter() - started, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=4000, help="tokens a prompt (4,000 pad to 4,096)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--slots", default="1,2,4,8")
    args = parser.parse_args()
    config = preset(args.shape)
    model = build_model(config, args.device, torch.bfloat16 if args.device == "cuda" else torch.float32, seed=0)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (args.tokens,), generator=generator).tolist()
               for _ in range(args.prompts)]
    rows = []
    for slots in (int(n) for n in args.slots.split(",")):
        scorer = PaddedScorer(model, slots=slots)
        scorer.score_many(prompts[:slots])   # captures the graph
        many_s, together = timed(model.device, lambda: [s.cpu() for s in scorer.score_many(prompts)])
        alone_s, alone = timed(model.device, lambda: scorer.score(prompts[slots - 1]).cpu())
        rows.append({"slots": slots, "prompts": args.prompts, "tokens": args.tokens,
                     "ms a prompt, all waiting": round(many_s / args.prompts * 1000, 2),
                     "ms one prompt alone": round(alone_s * 1000, 2),
                     "same bits alone": torch.equal(alone, together[slots - 1])})
        print(rows[-1], flush=True)
    print(f"\n{args.shape} drafter on {args.device}")
    print_table(rows)


if __name__ == "__main__":
    main()
