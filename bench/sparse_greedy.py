"""How many greedy outputs sparse attention changes: SmolLM2 on real papers, dense against sparse.

Sparse attention is lossy by design; this counts how many of a set of greedy summaries change
(token ids) when it is on, and where the first difference falls.

    python bench/sparse_greedy.py --papers 6 --top-k-blocks 8     # CPU, the real GGUF
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchd.samples import aclsum_papers  # noqa: E402
from bench.common import print_table  # noqa: E402
from batchd.engine.runtime import Engine, EngineConfig  # noqa: E402
from batchd.engine.types import GenerationRequest, SamplingParams  # noqa: E402
from tests.conftest import smollm2_gguf_path  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--papers", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=2500)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--top-k-blocks", type=int, default=8, help="sparse past 2 x this x 64 rows")
    args = parser.parse_args()
    path = str(smollm2_gguf_path())
    dense = Engine.load(path, EngineConfig(max_context=args.prompt_tokens + args.new_tokens + 64))
    sparse = Engine(dense.model, dense.codec, EngineConfig(max_context=dense.max_context, attention="sparse",
                    sparse_top_k_blocks=args.top_k_blocks), eos_ids=dense.eos_ids)
    rows = []
    for paper in aclsum_papers(args.papers):
        body = dense.codec.decode(dense.codec.encode(paper.text, add_special_tokens=False)[: args.prompt_tokens - 40])
        request = GenerationRequest(prompt=f"{body}\n\nSummarise the paper above in one sentence.", chat=True,
                                    sampling=SamplingParams(max_new_tokens=args.new_tokens))
        a, b = dense.generate(request), sparse.generate(request)
        first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                     None if a.token_ids == b.token_ids else min(len(a.token_ids), len(b.token_ids)))
        rows.append({"paper": paper.paper_id, "prompt tokens": a.prompt_tokens, "same ids": a.token_ids == b.token_ids,
                     "first difference at": first, "dense sha": a.output_sha256[:12], "sparse sha": b.output_sha256[:12]})
        print(rows[-1], flush=True)
    print_table(rows)
    changed = sum(not r["same ids"] for r in rows)
    print(f"\nsparse (top {args.top_k_blocks} blocks of 64 rows) changed {changed} of {len(rows)} greedy outputs")


if __name__ == "__main__":
    main()
