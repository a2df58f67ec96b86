"""Decode speed of the engine against the roofline and HF transformers, on one GPU.

Random weights at real models' shapes (speed does not depend on weight values); the reference
`transformers` model holds the very same tensors. Per shape: batch 1, a 512-token prompt, 256
greedy new tokens, then the same at 32K context. Prints one table:

    decode tok/s | roofline tok/s (weight + KV bytes per token over the copy bandwidth measured
    in this run) | fraction of roofline | transformers generate tok/s | speed-up

Run on the H200:  python bench/decode.py            (all shapes)
                  python bench/decode.py --shapes smollm2-135m --no-long
                  python bench/decode.py --compare-pdl   (adds tok/s with programmatic dependent
                                                          launch off, KernelOptions(pdl=False), same weights)
                  python bench/decode.py --v4-layers 4   (a DeepSeek V4-Flash-shaped model of 4 layers,
                                                          random bf16 weights: bench/v4_decode.py)
Smoke on a CPU:   python bench/decode.py --v4-layers 2 --v4-smoke --prompt 16 --new-tokens 4
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import copy_bandwidth, print_table  # noqa: E402
from bench.v4_shapes import layer_count  # noqa: E402
from batchd.engine.presets import hf_config_dict, preset  # noqa: E402
from batchd.engine.runtime import Engine, EngineConfig, build_model  # noqa: E402
from batchd.engine.types import GenerationRequest, SamplingParams  # noqa: E402
from batchd.kernels.options import kernel_options  # noqa: E402


def reference_model(config):
    import transformers

    hf_cfg = transformers.AutoConfig.for_model(**{k: v for k, v in hf_config_dict(config).items() if k != "architectures"})
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model.eval()


def weight_bytes_per_token(model) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:  # an untied embedding table is gathered, not read
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def kv_bytes_per_token(config, context: float, element_size: int = 2) -> float:
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * context * element_size


def time_ours(engine: Engine, prompt: list[int], new_tokens: int):
    request = GenerationRequest(sampling=SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    engine.generate_ids(prompt, request)  # warm-up: compile, capture graphs, autotune
    out = engine.generate_ids(prompt, request)
    return out, out.decode_tokens_per_s


@torch.no_grad()
def time_transformers(hf, prompt: list[int], new_tokens: int) -> float:
    ids = torch.tensor([prompt], device="cuda")
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    hf.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
    torch.cuda.synchronize()
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
    torch.cuda.synchronize()
    return (new_tokens - 1) / (time.perf_counter() - start - prefill)


def bench_shape(name: str, args, bandwidth: float) -> list[dict]:
    config = preset(name)
    hf = reference_model(config) if args.hf else None
    tensors = dict(hf.state_dict()) if hf is not None else None
    model = build_model(config, "cuda", torch.bfloat16, tensors=tensors)
    rows = []
    contexts = [args.prompt] + ([args.long] if args.long else [])
    for prompt_len in contexts:
        engine = Engine(model, None, EngineConfig(max_context=prompt_len + args.new_tokens + 16), eos_ids=set())
        prompt = torch.randint(0, config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
        out, tok_s = time_ours(engine, prompt, args.new_tokens)
        if args.compare_pdl:
            del engine
            with kernel_options(pdl=False):   # a fresh engine captures its graphs without PDL
                engine = Engine(model, None, EngineConfig(max_context=prompt_len + args.new_tokens + 16), eos_ids=set())
                off, off_tok_s = time_ours(engine, prompt, args.new_tokens)
            same = off.token_ids == out.token_ids
        avg_context = prompt_len + args.new_tokens / 2
        bytes_per_token = weight_bytes_per_token(model) + kv_bytes_per_token(config, avg_context)
        roofline = bandwidth / bytes_per_token
        row = {"shape": name, "context": prompt_len, "new": args.new_tokens, "decode tok/s": tok_s,
               "roofline tok/s": roofline, "of roofline": tok_s / roofline,
               "prefill tok/s": out and prompt_len / out.prefill_s}
        if args.compare_pdl:
            row.update({"PDL off tok/s": off_tok_s, "PDL gain": tok_s / off_tok_s, "same ids": same})
        if hf is not None:
            hf_new = args.hf_new_tokens if prompt_len == args.prompt else max(8, args.hf_new_tokens // 4)
            hf_tok_s = time_transformers(hf, prompt, hf_new)
            row.update({"HF tok/s": hf_tok_s, "x HF": tok_s / hf_tok_s})
        rows.append(row)
        print(row, flush=True)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    del model, hf, tensors
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="smollm2-135m,qwen2.5-1.5b,llama-3-8b")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--long", type=int, default=32768, help="second context length (0 to skip)")
    parser.add_argument("--no-long", dest="long", action="store_const", const=0)
    parser.add_argument("--hf-new-tokens", type=int, default=64)
    parser.add_argument("--no-hf", dest="hf", action="store_false")
    parser.add_argument("--no-fusion", dest="fusion", action="store_false")
    parser.add_argument("--compare-pdl", action="store_true", help="also time with kernel_options(pdl=False)")
    parser.add_argument("--v4-layers", type=layer_count, default=0,
                        help="time a DeepSeek V4-Flash-shaped model of this many layers instead of --shapes "
                             "('fit': as many as the GPU holds)")
    parser.add_argument("--v4-smoke", action="store_true", help="with --v4-layers: tiny sizes on the CPU")
    args = parser.parse_args()
    if args.v4_layers:
        from bench.v4_decode import bench_v4

        bandwidth = None if args.v4_smoke else copy_bandwidth()
        print_table([bench_v4(args.v4_layers, args.prompt, args.new_tokens, bandwidth, args.v4_smoke)])
        return
    torch.manual_seed(0)
    # --no-fusion changes nothing: the engine picks its kernels when built (engine.fused.kernels_for),
    # as the first Engine turned fusion on before
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth (read + write): {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows = []
    for name in args.shapes.split(","):
        rows += bench_shape(name, args, bandwidth)
    print_table(rows)


if __name__ == "__main__":
    main()
