"""Plain CPU decode through engine.linear's two routes for small steps, alternating on one engine:
oneDNN's product over a packed weight (the default where its rows are invariant) against one-row
F.linear calls (the fallback, and the only route before oneDNN). Greedy, SmolLM2-135M GGUF.

    python bench/cpu_linear_route.py [--rounds 3] [--new-tokens 64]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchd.config import default_model_path  # noqa: E402
from batchd.engine import linear  # noqa: E402
from batchd.engine.runtime import Engine, EngineConfig  # noqa: E402
from batchd.engine.types import GenerationRequest, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=300)
    args = parser.parse_args()
    engine = Engine.load(default_model_path(), EngineConfig(device="cpu",
                         max_context=args.prompt + args.new_tokens + 16))
    prompt = list(range(1000, 1000 + args.prompt))
    request = GenerationRequest(sampling=SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True))
    onednn_pack = linear._pack
    routes = {"onednn": onednn_pack, "one-row F.linear": lambda weight: None}
    speeds: dict[str, list[float]] = {name: [] for name in routes}
    ids = {}
    for _ in range(args.rounds):
        for name, pack in routes.items():
            linear._pack = pack
            linear._packed.clear()
            engine.generate_ids(prompt, request)                      # packs the weights
            out = engine.generate_ids(prompt, request)
            speeds[name].append(out.decode_tokens_per_s)
            ids[name] = out.token_ids
    linear._pack = onednn_pack
    for name, values in speeds.items():
        print(f"{name:18s} decode tok/s: " + ", ".join(f"{v:.1f}" for v in values))
    print(f"threads {torch.get_num_threads()}; same ids on both routes: {len(set(map(tuple, ids.values()))) == 1}")


if __name__ == "__main__":
    main()
