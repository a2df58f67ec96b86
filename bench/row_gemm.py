"""kernels.row_gemm against cuBLAS on the batch engine's decode projections (Llama-3-8B, bf16).

    python bench/row_gemm.py                       # the table and the whole-step estimate
    python bench/row_gemm.py --sweep               # time candidate configs per shape, print TUNED as Python
    python bench/row_gemm.py --device cpu --small  # smoke test on the CPU (tiny shapes, Triton interpreter)

For each projection (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336, lm_head
128256x4096) and M in 64 128 192 256 384 512 rows, three products:
  cublas  one F.linear of M rows (batch-dependent: cuBLAS picks its kernel by M; the speed to beat)
  slabs   engine.batch.rows.project_slabs, cuBLAS over fixed 128-row slabs (today's invariant path)
  row     kernels.row_gemm.row_linear with the table's config (invariant, one launch)
microseconds per call and TB/s of weight bytes (weight bytes / time: what a memory-bound decode
step can reach; the copy bandwidth of this GPU is printed for scale). Each timing replays a CUDA
graph of calls that cycle over enough weight copies (>= 256 MiB) that no call finds its weight in
L2, as in a real step. Before timing, each shape checks that row_linear's first rows at M equal
its one-row call bitwise (column `inv`). The whole-step estimate sums a layer's four projections
x 32 layers + lm_head, per M (projections only: no attention, norms or launches between).

--sweep times every candidate config (tiles, warps, stages) of each shape at the --sweep-rows and
keeps the fastest by the sum over them; it prints the winners as TUNED entries for
kernels/row_gemm/triton_kernel.py (paste them there: a new entry changes the bits of that weight's
rows, never their invariance). Configs that do not compile (shared memory) are skipped.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
            "lm_head": (128256, 4096)}
SMALL = {"qkv": (96, 64), "o": (64, 64), "gate_up": (160, 64), "down": (64, 112), "lm_head": (300, 64)}
LAYERS = 32
SLAB_ROWS = 128
L2_FLUSH_BYTES = 256 << 20


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny shapes and rows (with --device cpu: a smoke test)")
    parser.add_argument("--rows", type=int, nargs="+", default=None, help="M values (default 64 128 192 256 384 512)")
    parser.add_argument("--shapes", nargs="+", choices=list(LLAMA_8B), default=list(LLAMA_8B))
    parser.add_argument("--sweep", action="store_true", help="time candidate configs per shape instead")
    parser.add_argument("--sweep-rows", type=int, nargs="+", default=None,
                        help="M values a sweep sums (default 64 256 512)")
    parser.add_argument("--sweep-budget-s", type=float, default=100.0, help="seconds of sweeping per shape")
    args = parser.parse_args(argv)
    if args.rows is None:
        args.rows = [5, 17, 40] if args.small else [64, 128, 192, 256, 384, 512]
    if args.sweep_rows is None:
        args.sweep_rows = [17, 40] if args.small else [64, 256, 512]
    return args


class Shape:
    """A projection's weight copies (enough to miss L2 between calls) and x rows, on the device."""

    def __init__(self, name: str, N: int, K: int, max_rows: int, device: str, dtype):
        import torch

        self.name, self.N, self.K = name, N, K
        self.w_bytes = N * K * dtype.itemsize
        copies = 1 if device == "cpu" else max(1, -(-L2_FLUSH_BYTES // self.w_bytes))
        g = torch.Generator(device=device).manual_seed(0)
        self.weights = [(torch.randn(N, K, generator=g, device=device, dtype=torch.float32) / K**0.5).to(dtype)
                        for _ in range(copies)]
        self.x = torch.randn(max_rows, K, generator=g, device=device, dtype=torch.float32).to(dtype)
        self.calls = 2 if device == "cpu" else max(copies, 8)

    def launches(self, fn, M: int):
        x = self.x[:M]
        return [lambda w=self.weights[i % len(self.weights)]: fn(x, w) for i in range(self.calls)]


def time_calls(calls, device: str) -> float:
    """Seconds per call: on CUDA a graph of all calls replayed (bench.common.graph_time_per_call);
    on the CPU the wall clock of the calls (a smoke test, not a measurement)."""
    from bench.common import graph_time_per_call

    if device == "cpu":
        start = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - start) / len(calls)
    return graph_time_per_call(calls)


def products():
    """name -> fn(x, weight) for the three products compared."""
    import torch.nn.functional as F

    from batchd.engine.batch.rows import project_slabs
    from batchd.kernels.row_gemm import row_linear

    return {
        "cublas": lambda x, w: F.linear(x, w),
        "slabs": lambda x, w: project_slabs(x, w, None, SLAB_ROWS),
        "row": lambda x, w: row_linear(x, w, backend="triton"),
    }


def invariant(shape: Shape, M: int) -> bool:
    """row_linear's first row of an M-row call equals its one-row call, and its first M // 2 rows
    equal those of an (M // 2)-row call, bitwise."""
    import torch

    from batchd.kernels.row_gemm import row_linear

    x, w = shape.x[:M], shape.weights[0]
    full = row_linear(x, w, backend="triton")
    half = max(1, M // 2)
    return torch.equal(full[:1], row_linear(x[:1].clone(), w, backend="triton")) and \
        torch.equal(full[:half], row_linear(x[:half], w, backend="triton"))


def compare(args, shapes: dict[str, Shape]) -> None:
    from bench.common import print_table

    fns = products()
    rows, seconds = [], {}    # seconds[(name, M, product)]
    for name, shape in shapes.items():
        for M in args.rows:
            row = {"shape": f"{name} {shape.N}x{shape.K}", "M": M}
            for product, fn in fns.items():
                t = seconds[name, M, product] = time_calls(shape.launches(fn, M), args.device)
                row[f"{product} us"] = t * 1e6
                row[f"{product} TB/s"] = shape.w_bytes / t / 1e12
            row["row/slabs"] = seconds[name, M, "row"] / seconds[name, M, "slabs"]
            row["inv"] = "yes" if invariant(shape, M) else "NO"
            rows.append(row)
    print_table(rows)
    if set(shapes) == set(LLAMA_8B):
        print(f"\nwhole-step projections (ms): {LAYERS} x (qkv + o + gate_up + down) + lm_head")
        step = []
        for M in args.rows:
            row = {"M": M}
            for product in fns:
                layer = sum(seconds[n, M, product] for n in ("qkv", "o", "gate_up", "down"))
                row[f"{product} ms"] = (LAYERS * layer + seconds["lm_head", M, product]) * 1e3
            step.append(row)
        print_table(step)


def candidates(dtype):
    """Configs a sweep tries: 64/128-row m tiles, 64..256-row weight tiles, 64/128 k steps (bf16),
    4 or 8 warps, 3..5 stages, those whose pipelined tiles fit the H200's 227 KB of shared memory."""
    from batchd.kernels.row_gemm.triton_kernel import RowGemmConfig

    size = dtype.itemsize
    for bm, bn, bk, warps, stages in itertools.product((64, 128), (64, 128, 256), (64, 128), (4, 8), (3, 4, 5)):
        bk = bk * 2 // size
        if (bm + bn) * bk * size * stages <= 227 * 1024 and not (bm == 128 and bn == 256 and warps == 4):
            yield RowGemmConfig(bm, bn, bk, group_m=8, num_warps=warps, num_stages=stages)


def sweep(args, shapes: dict[str, Shape], dtype) -> None:
    from bench.common import print_table
    from batchd.kernels.row_gemm.triton_kernel import choose_config, row_linear_triton

    best = {}
    for name, shape in shapes.items():
        began, results = time.monotonic(), []
        table = choose_config(shape.N, shape.K, dtype)
        configs = [table] + [c for c in candidates(dtype) if c != table]
        if args.small:
            configs = configs[:3]
        for config in configs:
            if time.monotonic() - began > args.sweep_budget_s:
                print(f"{name}: budget spent after {len(results)} of {len(configs)} configs", flush=True)
                break
            try:
                times = [time_calls(shape.launches(lambda x, w, c=config: row_linear_triton(x, w, None, config=c), M),
                                    args.device) for M in args.sweep_rows]
            except Exception as error:     # out of shared memory or registers: not a candidate here
                print(f"{name} {config}: skipped ({type(error).__name__}: {str(error)[:80]})", flush=True)
                continue
            results.append((sum(times), times, config))
        results.sort(key=lambda r: r[0])
        rows = [{"shape": name, "config": describe(c), **{f"M={M} us": t * 1e6 for M, t in zip(args.sweep_rows, ts)},
                 "sum us": total * 1e6, "table": "*" if c == table else ""} for total, ts, c in results[:8]]
        print_table(rows)
        print()
        best[name] = results[0][2]
    print("# paste into TUNED (kernels/row_gemm/triton_kernel.py); measured by bench/row_gemm.py --sweep, "
          f"sum over M = {' '.join(map(str, args.sweep_rows))}")
    for name, config in best.items():
        N, K = shapes[name].N, shapes[name].K
        print(f"    ({N}, {K}, {dtype.itemsize}): RowGemmConfig({config.block_m}, {config.block_n}, {config.block_k}, "
              f"group_m={config.group_m}, num_warps={config.num_warps}, num_stages={config.num_stages}),  # {name}")


def describe(config) -> str:
    return (f"{config.block_m}x{config.block_n}x{config.block_k} g{config.group_m} "
            f"w{config.num_warps} s{config.num_stages}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before any Triton kernel module is imported
    import torch

    from bench.common import copy_bandwidth

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu --small for a smoke test")
    dtype = torch.bfloat16
    sizes = SMALL if args.small else LLAMA_8B
    max_rows = max(args.rows + args.sweep_rows)
    shapes = {name: Shape(name, *sizes[name], max_rows, args.device, dtype) for name in args.shapes}
    if args.device == "cuda":
        print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_bandwidth() / 1e12:.2f} TB/s (read + write)")
    else:
        print("CPU smoke test (Triton interpreter): the times mean nothing")
    if args.sweep:
        sweep(args, shapes, dtype)
    else:
        compare(args, shapes)


if __name__ == "__main__":
    main()
