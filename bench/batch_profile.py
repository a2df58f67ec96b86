"""Where a batched step's time goes: torch.profiler over the batch engine on a small workload,
the top ops by device time and by host time.

Run on the H200:  python bench/batch_profile.py --shape qwen2.5-1.5b --docs 32 --prompt 1024 --new 32
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchd.engine.batch import BatchOptions  # noqa: E402
from batchd.engine.presets import preset  # noqa: E402
from batchd.engine.runtime import Engine, EngineConfig, build_model  # noqa: E402
from batchd.engine.types import GenerationRequest, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-1.5b")
    parser.add_argument("--docs", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()
    config = preset(args.shape)
    engine = Engine(build_model(config, "cuda", torch.bfloat16), None, EngineConfig(max_context=args.prompt + args.new + 64),
                    eos_ids=set())
    batch = engine.batch_engine(BatchOptions(block_size=64))
    rng = random.Random(0)
    for _ in range(2):
        for _ in range(args.docs):
            batch.submit([rng.randrange(config.vocab_size) for _ in range(args.prompt)],
                         GenerationRequest(sampling=SamplingParams(max_new_tokens=args.new, ignore_eos=True)))
        while batch.scheduler.waiting or any(s.prefilling for s in batch.scheduler.running):
            batch.step()
        if _ == 0:
            while batch.has_work:
                batch.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            batch.step()
        torch.cuda.synchronize()
    table = prof.key_averages()
    print(table.table(sort_by="cuda_time_total", row_limit=args.rows))
    print(table.table(sort_by="cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
