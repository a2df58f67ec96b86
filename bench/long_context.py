"""Engine decode and verify speed at long context, dense against sparse attention, on one GPU.

The KV cache is filled with random rows up to the context length (speed does not depend on the
values; a real 128K prefill would only add minutes), then the engine runs one-token decode steps
and q-token verify steps at that length. Both replay CUDA graphs; sparse steps include the block
summary update and the top-k block selection.

    python bench/long_context.py --shape llama-3-8b --contexts 65536,131072
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table  # noqa: E402
from batchd.engine.presets import preset  # noqa: E402
from batchd.engine.runtime import Engine, EngineConfig, build_model  # noqa: E402


def fill_cache(engine: Engine, length: int) -> None:
    cache = engine.cache
    generator = torch.Generator(device=cache.device).manual_seed(0)
    for buffer in cache.keys + cache.values:
        buffer[:, :, :length].normal_(generator=generator)
    cache.truncate(0)
    cache.advance(length)
    for summary, keys in zip(cache.block_summaries or (), cache.keys):
        summary.reset()
        summary.update(keys, 0, length)


def step_seconds(engine: Engine, length: int, width: int, repeats: int) -> float:
    """Median seconds of one step of `width` tokens at cache length `length`."""
    tokens = torch.randint(0, engine.config.vocab_size, (1, width), device=engine.device)
    times = []
    for i in range(repeats + 2):
        engine.cache.truncate(length)
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.runner.step(tokens)
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3-8b")
    parser.add_argument("--contexts", default="65536,131072")
    parser.add_argument("--widths", default="1,5")
    parser.add_argument("--top-k-blocks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    config = preset(args.shape)
    model = build_model(config, "cuda", torch.bfloat16)
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = []
    for attention in ("dense", "sparse"):
        engine = Engine(model, None, EngineConfig(max_context=max(contexts) + 32, attention=attention,
                        sparse_top_k_blocks=args.top_k_blocks), eos_ids=set())
        for length in contexts:
            fill_cache(engine, length)
            for width in (int(w) for w in args.widths.split(",")):
                seconds = step_seconds(engine, length, width, args.repeats)
                rows.append({"attention": attention, "context": length, "tokens/step": width,
                             "step ms": seconds * 1e3, "steps/s": 1 / seconds,
                             "tokens/s if all accepted": width / seconds})
                print(rows[-1], flush=True)
        del engine
        torch.cuda.empty_cache()
    dense = {(r["context"], r["tokens/step"]): r["step ms"] for r in rows if r["attention"] == "dense"}
    for r in rows:
        r["dense/this"] = dense[(r["context"], r["tokens/step"])] / r["step ms"]
    print_table(rows)


if __name__ == "__main__":
    main()
