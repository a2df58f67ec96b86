"""Tune small_linear's `preload` (weight tiles requested before griddepcontrol.wait) on whole decode
steps: every tuned config gets the same depth, a fresh engine captures its graphs, and the decode
tok/s and greedy ids are compared with depth 0 (ids must be equal: preloading changes no sums).

    python bench/preload_sweep.py --shapes qwen2.5-1.5b,llama-3-8b --depths "0;1;2;4;2@20"
    python bench/preload_sweep.py --shapes llama-3-8b --depths "table;4096,4096=64,128,5,3"

A depth D@MB gives depth D only to weights of at least MB megabytes (0 to the others). A spec
N,K=bn,bk,splits,stages[,preload] instead replaces the table's entry for that one weight shape
(for trying a config in whole decode steps, where launches overlap, not in isolation).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import copy_bandwidth, print_table  # noqa: E402
from bench.decode import kv_bytes_per_token, time_ours, weight_bytes_per_token  # noqa: E402
from engine.presets import preset  # noqa: E402
from engine.runtime import Engine, build_model  # noqa: E402
from kernels.small_matmul import triton_kernel  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen2.5-1.5b,llama-3-8b")
    parser.add_argument("--depths", default="0;1;2;4", help="specs separated by ';' ('table': as it is)")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    tuned = dict(triton_kernel.TUNED)
    rows = []
    for name in args.shapes.split(","):
        config = preset(name)
        model = build_model(config, "cuda", torch.bfloat16)
        prompt = torch.randint(0, config.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
        roofline = bandwidth / (weight_bytes_per_token(model) + kv_bytes_per_token(config, args.prompt + args.new_tokens / 2))
        base_ids = None
        for spec in args.depths.split(";"):
            triton_kernel.TUNED.clear()
            triton_kernel.TUNED.update(tuned)
            if "=" in spec:
                shape, _, values = spec.partition("=")
                n, k = (int(v) for v in shape.split(","))
                bn, bk, splits, stages, *preload = (int(v) for v in values.split(","))
                triton_kernel.TUNED[(n, k, 2)] = triton_kernel.SmallLinearConfig(
                    bn, bk, splits, num_warps=4, num_stages=stages, swap=True, preload=preload[0] if preload else 0)
            elif spec != "table":
                depth, _, min_mb = spec.partition("@")
                triton_kernel.TUNED.update({
                    (n, k, size): dataclasses.replace(cfg, preload=int(depth) if n * k * size >= float(min_mb or 0) * 1e6 else 0)
                    for (n, k, size), cfg in tuned.items()})
            engine = Engine(model, None, max_context=args.prompt + args.new_tokens + 16, eos_ids=set())
            out, tok_s = time_ours(engine, prompt, args.new_tokens)
            base_ids = base_ids or out.token_ids
            rows.append({"shape": name, "preload": spec, "decode tok/s": tok_s, "of roofline": tok_s / roofline,
                         "same ids": out.token_ids == base_ids})
            print(rows[-1], flush=True)
            del engine
            gc.collect()
        del model
        gc.collect()
        torch.cuda.empty_cache()
    triton_kernel.TUNED.clear()
    triton_kernel.TUNED.update(tuned)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print_table(rows)


if __name__ == "__main__":
    main()
