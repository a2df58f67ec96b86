"""small_linear (batch-invariant, Triton) against torch.nn.functional.linear (cuBLAS) on decode shapes.

    python bench/small_matmul.py [--tune] [--tune-budget-s 100] [--json PATH]

Shapes: the decode projections of Qwen2.5-1.5B and Llama-3-8B, bf16, at M = 1, 5, 16 rows.
Bandwidth = weight bytes / time, over the copy bandwidth measured in this run (bench/common.py,
read + write). Each timing replays a CUDA graph of R calls that cycle over enough weight copies
(>= 256 MiB in all) that no call finds its weight in L2, as in a real decode step; time / R.
Before timing, every shape is checked on CUDA: row i of an M-row call equals the one-row call on
x[i] bitwise for M = 1..17 and 32 (cuBLAS is checked the same way, for contrast), and the result is
compared with a float32 product.

--tune first sweeps tile configs and k splits per shape at M = 1 (bf16), installs the fastest in
kernels.small_matmul.triton_kernel.TUNED for the rest of the run, and prints the table as Python.
--dry runs everything on tiny shapes on the CPU (Triton interpreter, wall-clock timing) to check
the script itself.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DRY = "--dry" in sys.argv
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import copy_bandwidth, graph_time_per_call, print_table  # noqa: E402
from batchd.kernels.small_matmul import small_linear  # noqa: E402
from batchd.kernels.small_matmul import triton_kernel as tk  # noqa: E402
from batchd.kernels.small_matmul.triton_kernel import SmallLinearConfig, small_linear_triton  # noqa: E402

# (model, name, N, K, bias)
SHAPES = [
    ("qwen2.5-1.5b", "qkv", 2048, 1536, True),
    ("qwen2.5-1.5b", "o", 1536, 1536, False),
    ("qwen2.5-1.5b", "gate_up", 17920, 1536, False),
    ("qwen2.5-1.5b", "down", 1536, 8960, False),
    ("qwen2.5-1.5b", "lm_head", 151936, 1536, False),
    ("llama-3-8b", "qkv", 6144, 4096, False),
    ("llama-3-8b", "o", 4096, 4096, False),
    ("llama-3-8b", "gate_up", 28672, 4096, False),
    ("llama-3-8b", "down", 4096, 14336, False),
    ("llama-3-8b", "lm_head", 128256, 4096, False),
]
BIG = {"gate_up", "down", "lm_head"}
ROWS = (1, 5, 16)
DTYPE = torch.bfloat16
DEV = "cpu" if DRY else "cuda"
ROTATE_BYTES = 256 << 20

if DRY:
    SHAPES = [("tiny", "qkv", 96, 64, True), ("tiny", "lm_head", 200, 96, False)]
    ROTATE_BYTES = 40_000


def sm_count() -> int:
    return tk.multiprocessor_count(torch.device(DEV))


def candidates(N: int, K: int, narrow: bool = True) -> list[SmallLinearConfig]:
    """Tile configs x k splits reaching about 1, 2, 4, 8 programs per multiprocessor (and no split)."""
    sms = sm_count()
    out = []
    shapes = [(64, 128, 3), (64, 128, 4), (64, 256, 3), (128, 128, 3), (128, 128, 4), (128, 256, 3)]
    if narrow:       # fewer weight rows per program: more programs without a k split (and its reduce)
        shapes = shapes[:3] + [(16, 256, 4), (16, 512, 3), (16, 512, 4), (32, 256, 3), (32, 256, 4), (32, 512, 3)]
    tiles = [(bn, bk, st, sw) for sw in (True, False) for bn, bk, st in shapes]
    if DRY:
        tiles = [(32, 32, 2, True), (64, 32, 2, False)]
    for bn, bk, st, sw in tiles:
        n_blocks, k_blocks = math.ceil(N / bn), math.ceil(K / bk)
        splits = {1} | {max(1, min(k_blocks, math.ceil(t * sms / n_blocks))) for t in (1, 2, 4, 8)}
        effective = {}
        for s in sorted(splits):
            cfg = SmallLinearConfig(bn, bk, s, num_warps=4, num_stages=st, swap=sw)
            effective.setdefault(cfg.effective_splits(K), cfg)       # one per effective split count
        out += list(effective.values())
    return out


class Problem:
    """Weight copies (>= ROTATE_BYTES in all, so the timed loop streams from HBM), a bias, inputs."""

    def __init__(self, N: int, K: int, bias: bool, seed: int = 0):
        g = torch.Generator(device=DEV).manual_seed(seed)
        w_bytes = N * K * DTYPE.itemsize
        self.copies = max(2, math.ceil(ROTATE_BYTES / w_bytes))
        self.weights = [
            (torch.randn(N, K, generator=g, device=DEV, dtype=torch.float32) / K**0.5).to(DTYPE)
            for _ in range(self.copies)
        ]
        self.bias = torch.randn(N, generator=g, device=DEV).to(DTYPE) if bias else None
        self.x = torch.randn(32, K, generator=g, device=DEV).to(DTYPE)
        self.w_bytes = w_bytes
        self.calls = max(self.copies, 16)

    def launches(self, fn, M: int):
        x = self.x[:M]
        return [lambda w=self.weights[i % self.copies]: fn(x, w, self.bias) for i in range(self.calls)]


def graph_time(calls) -> float:
    """Seconds per call: a CUDA graph of all calls, replayed (median of 10 after warm-up)."""
    if DRY:
        start = time.perf_counter()
        for c in calls[:2]:
            c()
        return (time.perf_counter() - start) / 2
    return graph_time_per_call(calls)


def cublas(x, w, b):
    return F.linear(x, w, b)


def with_config(cfg):
    return lambda x, w, b: small_linear_triton(x, w, b, config=cfg)


def same(a: SmallLinearConfig, b: SmallLinearConfig, K: int) -> bool:
    return (a.block_n, a.block_k, a.num_warps, a.num_stages, a.swap, a.effective_splits(K)) == (
        b.block_n, b.block_k, b.num_warps, b.num_stages, b.swap, b.effective_splits(K))


def tune(budget_s: float, only: set[str] | None = None) -> dict:
    """Fastest config per shape at M = 1; shapes with no time left keep the table."""
    start = time.perf_counter()
    chosen = {}
    for model, name, N, K, bias in SHAPES:
        if only and f"{model}:{name}" not in only and name not in only:
            continue
        if time.perf_counter() - start > budget_s:
            print(f"tune: out of budget before {model} {name}", flush=True)
            break
        p = Problem(N, K, bias=False)                    # the bias is an epilogue: tuned without it
        results = []
        for cfg in candidates(N, K, narrow=N * K * 2 < (64 << 20)):
            if time.perf_counter() - start > budget_s:
                break
            try:
                results.append((graph_time(p.launches(with_config(cfg), 1)), cfg))
            except Exception as e:                       # e.g. out of shared memory at 4 stages
                print(f"tune: {N}x{K} {cfg} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
        if results:
            results.sort(key=lambda r: r[0])
            t, cfg = results[0]
            table = tk.choose_config(N, K, DTYPE, torch.device(DEV))
            t_table = next((r[0] for r in results if same(r[1], table, K)), float("nan"))
            print(f"tune: {model} {name} {N}x{K}: best {t * 1e6:.1f} us {cfg} "
                  f"(current table/heuristic {t_table * 1e6:.1f} us; {len(results)} tried; top3 "
                  + ", ".join(f"{r[0] * 1e6:.1f}" for r in results[:3]) + ")", flush=True)
            chosen[(N, K, 2)] = cfg
        del p
        if not DRY:
            torch.cuda.empty_cache()
    tk.TUNED.update(chosen)
    return chosen


def invariance(N: int, K: int, bias: bool) -> dict:
    p = Problem(N, K, bias, seed=7)
    x, w, b = p.x, p.weights[0], p.bias
    res = {}
    for label, fn in (("small", lambda x_: small_linear(x_, w, b, backend="triton")), ("cublas", lambda x_: F.linear(x_, w, b))):
        alone = torch.cat([fn(x[i:i + 1].clone()) for i in range(32)])
        ok = all(torch.equal(fn(x[:M]), alone[:M]) for M in [*range(1, 18), 32])
        res[label] = ok
        if label == "small":
            ref = x.float() @ w.float().t() + (b.float() if b is not None else 0.0)
            res["rel_err"] = ((alone.float() - ref).norm() / ref.norm()).item()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--tune-budget-s", type=float, default=75.0)
    ap.add_argument("--only", default="", help="tune only these shapes: proj or model:proj, comma-separated")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry", action="store_true")
    args = ap.parse_args()

    if DRY:
        copy_bw = 1e9
    else:
        print(torch.cuda.get_device_name(), "SMs", sm_count(), flush=True)
        copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)", flush=True)

    tuned = tune(args.tune_budget_s, {s for s in args.only.split(",") if s}) if args.tune else {}
    if tuned:
        print("TUNED = {")
        for (N, K, size), c in tuned.items():
            print(f"    ({N}, {K}, {size}): SmallLinearConfig({c.block_n}, {c.block_k}, {c.splits}, "
                  f"num_warps={c.num_warps}, num_stages={c.num_stages}, swap={c.swap}),")
        print("}", flush=True)

    rows, checks = [], []
    for model, name, N, K, bias in SHAPES:
        try:
            inv = invariance(N, K, bias)
        except Exception:
            traceback.print_exc()
            inv = {"small": None, "cublas": None, "rel_err": float("nan")}
        cfg = tk.choose_config(N, K, DTYPE, torch.device(DEV))
        checks.append({"model": model, "proj": name, "N": N, "K": K, "config": str(cfg), **inv})
        print(f"check {model} {name}: invariant small={inv['small']} cublas={inv['cublas']} "
              f"rel_err={inv['rel_err']:.2e} config={cfg}", flush=True)
        p = Problem(N, K, bias)
        for M in ROWS:
            try:
                t_cub = graph_time(p.launches(cublas, M))
                t_small = graph_time(p.launches(lambda x, w, b: small_linear(x, w, b, backend="triton"), M))
            except Exception:
                traceback.print_exc()
                t_cub = t_small = float("nan")
            rows.append({
                "model": model, "proj": name, "N": N, "K": K, "M": M,
                "cublas_us": t_cub * 1e6, "small_us": t_small * 1e6,
                "cublas_%copy": 100 * p.w_bytes / t_cub / copy_bw,
                "small_%copy": 100 * p.w_bytes / t_small / copy_bw,
                "speedup": t_cub / t_small,
                "invariant": {True: "yes", False: "NO", None: "err"}[inv["small"]],
            })
        del p
        if not DRY:
            torch.cuda.empty_cache()

    if args.json:
        Path(args.json).write_text(json.dumps({
            "copy_bw": copy_bw, "rows": rows, "checks": checks,
            "tuned": {f"{k[0]}x{k[1]}x{k[2]}": vars(v) for k, v in tuned.items()},
        }, indent=1))
    print()
    print(f"small_linear vs F.linear (cuBLAS), bf16, CUDA-graph replay, copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    print_table(rows)
    big_m1 = [r for r in rows if r["M"] == 1 and r["proj"] in BIG]
    m1 = [r for r in rows if r["M"] == 1]
    print(f"M=1: small >= cuBLAS on {sum(r['speedup'] >= 1 for r in m1)}/{len(m1)} shapes; "
          f">= 80% copy on {sum(r['small_%copy'] >= 80 for r in big_m1)}/{len(big_m1)} big shapes; "
          f"invariant on {sum(c['small'] is True for c in checks)}/{len(checks)} shapes "
          f"(cuBLAS on {sum(c['cublas'] is True for c in checks)})")


if __name__ == "__main__":
    main()
