"""One small_linear launch per config, for Nsight Compute to read its counters (no timing here).

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats -k regex:small_linear \\
        python bench/ncu_linear.py --spec "2048,1536=16,128,1,4" --spec "2048,1536=16,128,1,8"

Each --spec is bench/step_sweep.py's N,K= syntax (bench.common.linear_config); each config runs
twice (the first call compiles), weights random bf16 at M = --rows (1). ncu flushes the caches
before each profiled launch (its default --cache-control all), so the weights come from HBM.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import linear_config  # noqa: E402
from batchd.kernels.small_matmul.triton_kernel import small_linear_triton  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", action="append", required=True)
    parser.add_argument("--rows", type=int, default=1, help="M, the rows of x")
    parser.add_argument("--torch", action="store_true", help="also run torch's F.linear (cuBLAS) on each shape")
    args = parser.parse_args()
    for spec in args.spec:
        shape, _, values = spec.partition("=")
        n, k = (int(v) for v in shape.split(","))
        config = linear_config(values)
        x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):
            small_linear_triton(x, w, None, config=config)
            if args.torch:
                torch.nn.functional.linear(x, w)
        torch.cuda.synchronize()
        print(spec, flush=True)


if __name__ == "__main__":
    main()
