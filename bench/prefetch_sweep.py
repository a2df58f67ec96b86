"""Try L2 prefetch schedules (engine.prefetch) on whole decode steps: each schedule gets a fresh
engine (its graphs captured under it), and its decode tok/s and greedy ids are compared with the
first schedule's (ids must be equal: a prefetch changes no value).

    python bench/prefetch_sweep.py --shapes qwen2.5-1.5b --schedules "off;qkv=o;qkv=o,attn=gate_up:16"
    python bench/prefetch_sweep.py --shapes qwen2.5-1.5b --prompt 32768 --schedules "off;default"

"default" is engine.prefetch.DEFAULT_SCHEDULE (what an engine runs when BATCHD_L2_PREFETCH is unset).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import copy_bandwidth, print_table  # noqa: E402
from bench.decode import kv_bytes_per_token, time_ours, weight_bytes_per_token  # noqa: E402
from engine import prefetch as prefetch_schedule  # noqa: E402
from engine.presets import preset  # noqa: E402
from engine.runtime import Engine, build_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen2.5-1.5b")
    parser.add_argument("--schedules", default="off;default", help="schedules separated by ';'")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    rows = []
    for name in args.shapes.split(","):
        config = preset(name)
        model = build_model(config, "cuda", torch.bfloat16)
        prompt = torch.randint(0, config.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
        roofline = bandwidth / (weight_bytes_per_token(model) + kv_bytes_per_token(config, args.prompt + args.new_tokens / 2))
        base_ids = None
        for spec in args.schedules.split(";"):
            schedule = prefetch_schedule.DEFAULT_SCHEDULE if spec == "default" else spec
            prefetch_schedule.parse_schedule(schedule)             # a bad spec fails before any timing
            os.environ["BATCHD_L2_PREFETCH"] = schedule
            engine = Engine(model, None, max_context=args.prompt + args.new_tokens + 16, eos_ids=set())
            out, tok_s = time_ours(engine, prompt, args.new_tokens)
            base_ids = base_ids or out.token_ids
            rows.append({"shape": name, "context": args.prompt, "schedule": spec, "decode tok/s": tok_s,
                         "of roofline": tok_s / roofline, "same ids": out.token_ids == base_ids})
            print(rows[-1], flush=True)
            del engine
            gc.collect()
        del model
        gc.collect()
        torch.cuda.empty_cache()
    os.environ.pop("BATCHD_L2_PREFETCH", None)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print_table(rows)


if __name__ == "__main__":
    main()
