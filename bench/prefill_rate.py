"""Prefill rate of one sequence at short and long prompts: the one-sequence forward
(`model.forward_at` over a contiguous cache), as the batch engine runs a prompt's first chunk.
Prints milliseconds, TFLOP/s and the share of the bf16 matmul ceiling measured in the same run,
with the fused decode MLP's transposed down weight (the engine's default) and without it; then the
top kernels of one forward at --profile-tokens.

Run on the H200:  python bench/prefill_rate.py
                  python bench/prefill_rate.py --shape qwen2.5-0.5b --tokens 800 4096
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import cuda_time, print_table  # noqa: E402
from bench.decode import weight_bytes_per_token  # noqa: E402
from bench.throughput import matmul_rate  # noqa: E402
from batchd.engine.kv_cache import ContiguousKVCache  # noqa: E402
from batchd.engine.presets import preset  # noqa: E402
from batchd.engine.runtime import build_model  # noqa: E402


def prefill_flops(model, config, tokens: int) -> float:
    """Projection FLOPs (2 per weight per token; the head runs on the last row only) plus causal
    attention's (QK and PV)."""
    params = weight_bytes_per_token(model) / 2 - model.lm_head.weight.numel()
    return 2 * params * tokens + 2 * config.num_layers * config.num_heads * config.head_dim * tokens * tokens


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3-8b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 800, 1024, 2048, 4096])
    parser.add_argument("--profile-tokens", type=int, default=800)
    parser.add_argument("--rows", type=int, default=15)
    args = parser.parse_args()
    flops = matmul_rate()
    config = preset(args.shape)
    model = build_model(config, "cuda", torch.bfloat16, seed=0)
    cache = ContiguousKVCache(config, max(args.tokens) + 64, model.device, model.dtype)
    prompts = {t: torch.randint(0, config.vocab_size, (1, t), device="cuda") for t in args.tokens}

    def forward(t: int):
        cache.reset()
        return model.forward_at(prompts[t], cache, 0, last_only=True)

    rows = []
    for fused in (True, False):
        model.use_fused_mlp(fused)
        for t in args.tokens:
            seconds = cuda_time(lambda: forward(t))
            rate = prefill_flops(model, config, t) / seconds
            rows.append({"down weight": "transposed (fused MLP)" if fused else "plain", "tokens": t,
                         "ms": seconds * 1e3, "TFLOP/s": rate / 1e12, "of matmul ceiling": rate / flops})
    print(f"{args.shape}, bf16 matmul ceiling {flops / 1e12:.0f} TFLOP/s")
    print_table(rows)
    model.use_fused_mlp(True)
    forward(args.profile_tokens)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        forward(args.profile_tokens)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
