"""What the host's read-back of the ids costs the plain greedy decode loop (engine.generate).

The loop copies each batch of `sync_every` ids to the host and reads it `read_lag` steps later.
Per shape (random weights, batch 1, a 512-token prompt, 256 new tokens, one engine) this prints the
decode tok/s of several (sync_every, read_lag) settings, each run twice in alternation; 256 steps
with one read at the end is the bound nothing on the host can beat. The ids must not change.

Run on the H200:  python bench/readback.py
                  python bench/readback.py --shapes qwen2.5-1.5b --settings "16,0;16,2;256,0"
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table  # noqa: E402
from batchd.engine.generate import generate_plain  # noqa: E402
from batchd.engine.presets import preset  # noqa: E402
from batchd.engine.runtime import Engine, EngineConfig, build_model  # noqa: E402
from batchd.engine.sampling import Sampler  # noqa: E402
from batchd.engine.stopping import StopChecker  # noqa: E402
from batchd.engine.types import SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen2.5-1.5b,llama-3-8b")
    parser.add_argument("--settings", default="16,0;16,2;256,0", help="sync_every,read_lag pairs, ';'-separated")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args()
    settings = [tuple(int(v) for v in s.split(",")) for s in args.settings.split(";")]
    rows = []
    for name in args.shapes.split(","):
        config = preset(name)
        model = build_model(config, "cuda", torch.bfloat16)
        engine = Engine(model, None, EngineConfig(max_context=args.prompt + args.new_tokens + 16), eos_ids=set())
        engine.warm_up()
        prompt = torch.randint(0, config.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
        sampling = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
        speeds: dict[tuple[int, int], list[float]] = {s: [] for s in settings}
        ids = {}
        for _ in range(2):
            for every, lag in settings:
                engine.cache.reset()
                stopper = StopChecker(set(), args.new_tokens, ignore_eos=True)
                out = generate_plain(engine.runner, prompt, Sampler(sampling, engine.device), stopper,
                                     sync_every=every, read_lag=lag)
                speeds[(every, lag)].append(out.decode_tokens_per_s)
                ids[(every, lag)] = out.token_ids
        first = ids[settings[0]]
        for (every, lag), runs in speeds.items():
            rows.append({"shape": name, "sync_every": every, "read_lag": lag,
                         "decode tok/s": " / ".join(f"{r:.1f}" for r in runs),
                         "vs first": max(runs) / max(speeds[settings[0]]), "same ids": ids[(every, lag)] == first})
        del engine, model
        torch.cuda.empty_cache()
    print_table(rows)


if __name__ == "__main__":
    main()
