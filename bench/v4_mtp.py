"""DeepSeek V4's MTP layer drafting in the V4 batch engine: what a step costs, with it and without.

Random bf16 weights at V4-Flash's layer shape (hidden 4096, 64 heads of 512, 1024-rank q and o,
hc_mult 4, vocab 129280, 6 experts a token; the MTP block sliding-window with a learned router, as
V4-Flash's), its 43 layers, and fewer experts (--experts 16, not 256) so that it fits one GPU: a
token reads 6 of them whatever the count, so the MTP's cost against a step stays the real ratio. Random
weights make the MTP's drafts nearly always rejected: the rows measure what drafting and a verify
of 1 + k rows cost against a plain decode step (acceptance is in the table; it is not the real
model's). Every row checks that its tokens equal plain decoding's (the head's weights are spread so
that greedy picks are far from ties; were one close, bf16 could still round a verify row apart from
a decode row: docs/deepseek_v4.md, "Chunking"; --dtype float32 holds exactly).

Per row: one prompt of --prompt random tokens -> --new greedy tokens (EOS ignored). Columns: steps
(decode steps), ms/step (wall, all of it), mtp ms/step (the MTP's catch-up and chained drafts,
synchronised), tok/s, drafts offered and accepted.

Run on the H200:  python bench/v4_mtp.py
                  python bench/v4_mtp.py --layers 8 --widths 1 2 4 --new 64
CPU smoke (real shape, minutes):  python bench/v4_mtp.py --device cpu --layers 2 --experts 6 --prompt 40 --new 5
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table  # noqa: E402
from batchd.engine.deepseek_v4 import V4Config, build_model  # noqa: E402
from batchd.engine.deepseek_v4.batch import V4BatchEngine  # noqa: E402
from batchd.engine.deepseek_v4.config import CSA, HCA, SLIDING, RopeParams  # noqa: E402
from batchd.engine.deepseek_v4.model import keeps_float32  # noqa: E402
from batchd.engine.deepseek_v4.mtp import MTPLayer  # noqa: E402
from batchd.engine.generate import synchronize  # noqa: E402
from batchd.engine.types import GenerationRequest, SamplingParams, SpeculationOptions  # noqa: E402


def flash_shape(layers: int, experts: int) -> V4Config:
    """V4-Flash's per-layer shape; its layer pattern (two HCA, then CSA / HCA) over `layers`."""
    kinds = [HCA] * min(layers, 2) + [CSA if i % 2 else HCA for i in range(max(layers - 2, 0))]
    return V4Config(vocab_size=129280, hidden_size=4096, num_layers=layers, num_heads=64, head_dim=512,
                    q_lora_rank=1024, moe_intermediate_size=2048, num_experts=experts, experts_per_token=6,
                    layer_types=kinds, mlp_layer_types=["hash_moe"] * min(layers, 3) + ["moe"] * max(layers - 3, 0),
                    compress_rates={CSA: 4, HCA: 128}, rope_dim=64, rope_main=RopeParams(theta=10000.0),
                    rope_compress=RopeParams(theta=160000.0))


def randomise(module: torch.nn.Module, vocab: int, experts: int) -> None:
    """Weights ~ N(0, 0.02), norms 1, biases and bases 0, hash routing tables random; the head
    ~ N(0, 0.5), which spreads the logits so that greedy picks are far from bf16 ties."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif "base" in name or "sinks" in name or "position_bias" in name:
                param.zero_()
            elif name.endswith("scale"):
                param.fill_(1.0)
            elif name == "lm_head.weight":
                param.normal_(0, 0.5)
            else:
                param.normal_(0, 0.02)
        for name, buffer in module.named_buffers():
            if name.endswith("tid2eid"):
                buffer.copy_(torch.randint(0, experts, buffer.shape))
            else:
                buffer.zero_()


def random_mtp(config: V4Config, device, dtype) -> MTPLayer:
    with torch.device("meta"):
        layer = MTPLayer(replace(config, num_layers=1, layer_types=[SLIDING], mlp_layer_types=["moe"]))
    layer = layer.to_empty(device=device)
    for name, param in layer.named_parameters():
        param.data = param.data.to(torch.float32 if keeps_float32(name) else dtype)
    randomise(layer, config.vocab_size, config.num_experts)
    return layer.eval().requires_grad_(False)


def timed_drafter(engine: V4BatchEngine) -> list[float]:
    """Wrap the engine's MTP calls with synchronised timers; -> the list their seconds go into."""
    spent, device = [0.0], engine.model.device
    if engine.mtp is None:
        return spent
    for method in ("observe", "propose"):
        inner = getattr(engine.mtp, method)

        def timed(*args, _inner=inner):
            synchronize(device)
            began = time.perf_counter()
            out = _inner(*args)
            synchronize(device)
            spent[0] += time.perf_counter() - began
            return out
        setattr(engine.mtp, method, timed)
    return spent


def run(model, mtp, prompt: list[int], new: int, method: str, width) -> dict:
    engine = V4BatchEngine(model, max_context=len(prompt) + new + 32, eos_ids=set(), chunk=256, mtp=mtp)
    spent = timed_drafter(engine)
    request = GenerationRequest(sampling=SamplingParams(max_new_tokens=new, ignore_eos=True),
                                speculation=SpeculationOptions(method=method, width=width))
    seq = engine.submit(prompt, request)
    while seq.prompt_done_at is None:
        engine.step()
    spent[0], steps = 0.0, 0
    synchronize(model.device)
    began = time.perf_counter()
    while engine.has_work:
        engine.step()
        steps += 1
    synchronize(model.device)
    seconds = time.perf_counter() - began
    return {"mode": "plain" if method == "none" else method,
            "width": width or ("adaptive" if method == "draft" else ""),
            "steps": steps, "ms/step": 1e3 * seconds / steps, "mtp ms/step": 1e3 * spent[0] / steps,
            "tok/s": (len(seq.generated) - 1) / seconds, "offered": seq.spec_offered, "accepted": seq.spec_accepted,
            "ids": seq.generated}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=43)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="float32: 'same ids' holds exactly (bf16 rounds a verify row apart from a decode row)")
    args = parser.parse_args()
    if args.experts < 6:
        parser.error("--experts must be at least 6: V4 routes each token to 6")
    torch.manual_seed(0)
    config, dtype = flash_shape(args.layers, args.experts), getattr(torch, args.dtype)
    model = build_model(config, args.device, dtype)
    randomise(model, config.vocab_size, config.num_experts)
    mtp = random_mtp(config, args.device, dtype)
    prompt = torch.randint(0, config.vocab_size, (args.prompt,)).tolist()
    plain = run(model, None, prompt, args.new, "none", None)
    rows = [plain] + [run(model, mtp, prompt, args.new, "draft", w) for w in [*args.widths, None]]
    plain_ids = plain["ids"]
    for row in rows:
        row["same ids"] = row.pop("ids") == plain_ids
    print(f"V4 shape, {args.dtype}: {args.layers} layers, {args.experts} experts, prompt {args.prompt}, "
          f"{args.new} new tokens, "
          f"{torch.cuda.get_device_name() if args.device.startswith('cuda') else args.device}")
    print_table(rows)


if __name__ == "__main__":
    main()
