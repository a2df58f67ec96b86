"""DeepSeek V4's MTP layer drafting in the V4 batch engine: what a step costs, with it and without.

Random bf16 weights at V4-Flash's layer shapes (bench/v4_shapes.py: transformers' DeepseekV4Config
defaults; the MTP block sliding-window with a learned router, as V4-Flash's), 41 of its 43 layers
and fewer experts (--experts 16, not 256) so that it fits one GPU: a token reads 6 of them whatever
the count, so the MTP's cost against a step stays close to the real ratio. Random
weights make the MTP's drafts nearly always rejected: the rows measure what drafting and a verify
of 1 + k rows cost against a plain decode step (acceptance is in the table; it is not the real
model's). Every row checks that its tokens equal plain decoding's: V4's row-invariant path
(engine.deepseek_v4.rows) makes a verify row its decode row bit for bit, so "same ids" must hold in
bf16 too (proven on the CPU and, with this bench, on the H200).

Per row: --sequences prompts (default one) of --prompt random tokens in flight together -> --new
greedy tokens each (EOS ignored). Columns: steps (decode steps), ms/step (wall, all of it), mtp
ms/step (the MTP's catch-up and chained drafts, synchronised), tok/s (all sequences), drafts
offered and accepted.

Run on the H200:  python bench/v4_mtp.py
                  python bench/v4_mtp.py --layers 8 --widths 1 2 4 --new 64
                  python bench/v4_mtp.py --layers 8 --widths 4 --sequences 12   (drafts of many sequences)
CPU smoke:        python bench/v4_mtp.py --device cpu --smoke --layers 3 --prompt 40 --new 8
                  python bench/v4_mtp.py --device cpu --layers 2 --experts 6 --prompt 40 --new 5  (real sizes)
                  python bench/v4_mtp.py --device cpu --smoke --layers 3 --prompt 100 --new 24 --widths 4 --sequences 12
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
from bench.v4_shapes import random_v4_model, v4_config  # noqa: E402
from batchd.engine.deepseek_v4.batch import V4BatchEngine  # noqa: E402
from batchd.engine.deepseek_v4.config import SLIDING, V4Config  # noqa: E402
from batchd.engine.deepseek_v4.model import allocate  # noqa: E402
from batchd.engine.deepseek_v4.mtp import MTPLayer  # noqa: E402
from batchd.engine.generate import synchronize  # noqa: E402
from batchd.engine.types import GenerationRequest, SamplingParams, SpeculationOptions  # noqa: E402


@torch.no_grad()
def random_mtp(config: V4Config, device, dtype) -> MTPLayer:
    """V4-Flash's MTP block (sliding window, learned router) of random weights, as random_v4_model's."""
    with torch.device("meta"):
        layer = MTPLayer(replace(config, num_layers=1, layer_types=[SLIDING], mlp_layer_types=["moe"]))
    allocate(layer, device, dtype)
    for name, param in layer.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0, 0.02)
    for buffer in layer.buffers():
        buffer.zero_()
    return layer.eval().requires_grad_(False)


def timed_drafter(engine: V4BatchEngine) -> list[float]:
    """Wrap the engine's MTP calls with synchronised timers; -> the list their seconds go into."""
    spent, device = [0.0], engine.model.device
    if engine.mtp is None:
        return spent
    for method in ("observe_many", "propose_many"):
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


def run(model, mtp, prompts: list[list[int]], new: int, method: str, width) -> dict:
    """The prompts in flight together (one sequence, or --sequences of them) -> a table row."""
    engine = V4BatchEngine(model, max_context=max(map(len, prompts)) + new + 32, eos_ids=set(), chunk=256, mtp=mtp,
                           max_running=len(prompts))
    spent = timed_drafter(engine)
    request = GenerationRequest(sampling=SamplingParams(max_new_tokens=new, ignore_eos=True),
                                speculation=SpeculationOptions(method=method, width=width))
    seqs = [engine.submit(prompt, request) for prompt in prompts]
    while any(seq.prompt_done_at is None for seq in seqs):
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
            "tok/s": sum(len(seq.generated) - 1 for seq in seqs) / seconds,
            "offered": sum(seq.spec_offered for seq in seqs), "accepted": sum(seq.spec_accepted for seq in seqs),
            "ids": [seq.generated for seq in seqs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=41, help="layers of V4-Flash's (1..41; it has 43)")
    parser.add_argument("--experts", type=int, default=16, help="routed experts (V4-Flash: 256; a token reads 6)")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--sequences", type=int, default=1, help="sequences in flight together (each its own prompt)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="the weights' dtype ('same ids' must hold in both)")
    parser.add_argument("--smoke", action="store_true", help="the tests' tiny sizes (a CPU smoke run)")
    args = parser.parse_args()
    config = v4_config(args.layers, tiny=args.smoke)
    if not args.smoke:
        if args.experts < config.experts_per_token:
            parser.error(f"--experts must be at least {config.experts_per_token}: each token reads that many")
        config = replace(config, num_experts=args.experts)
    dtype = getattr(torch, args.dtype)
    model = random_v4_model(config, args.device, dtype)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.5)   # spread logits: greedy picks far from bf16 ties
    mtp = random_mtp(config, args.device, dtype)
    prompts = [torch.randint(0, config.vocab_size, (args.prompt,)).tolist() for _ in range(args.sequences)]
    plain = run(model, None, prompts, args.new, "none", None)
    rows = [plain] + [run(model, mtp, prompts, args.new, "draft", w) for w in [*args.widths, None]]
    plain_ids = plain["ids"]
    for row in rows:
        row["same ids"] = row.pop("ids") == plain_ids
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"V4 {'tiny' if args.smoke else 'Flash'} shape, {args.dtype}: {args.layers} layers + MTP, "
          f"{config.num_experts} experts, {args.sequences} x prompt {args.prompt}, {args.new} new tokens, {where}")
    print_table(rows)


if __name__ == "__main__":
    main()
