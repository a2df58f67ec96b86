"""The two elementwise kernels of a prefill chunk, old against new, against copy bandwidth.

- rope + cache write (kernels.rope_cache): the per-row grid of decode (one program per row and
  head) against the row-block grid that prefill-sized steps now take; their outputs must be equal.
- silu * up: the torch.compile'd `engine.fused.silu_mul` (dynamic shapes, as `cuda_kernels`
  builds it) against kernels.silu_mul, which must equal its eager twin bit for bit; `--tiles` adds
  a few of the kernel's tile shapes.

Shapes: Qwen2.5-0.5B (PFlash's drafter) and Llama-3-8B (the target), bf16, one sequence of 832
(an 800-token first chunk padded to 64) and 4,096 rows. GB/s counts bytes read plus bytes
written once; "of copy" divides by a device-to-device copy measured in the same run.

    python bench/prefill_elementwise.py [--tiles]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import copy_bandwidth, cuda_time, print_table  # noqa: E402
from batchd.engine import fused  # noqa: E402
from batchd.engine.presets import preset  # noqa: E402
from batchd.kernels.rope_cache.triton_kernel import launch_per_row, launch_row_blocks  # noqa: E402
from batchd.kernels.silu_mul import silu_mul_reference  # noqa: E402
from batchd.kernels.silu_mul.triton_kernel import silu_mul_triton  # noqa: E402

SHAPES = ("qwen2.5-0.5b", "llama-3-8b")
ROWS = (832, 4096)
CALLS = 20          # launches per timed call: the kernels take 10-100 us
DTYPE = torch.bfloat16
DEVICE = "cuda"
TILES = [(1, 1024, 4), (4, 1024, 4), (4, 1024, 8), (8, 512, 4), (16, 256, 4)]   # (block_m, block_n, num_warps)


def per_call(fn) -> float:
    """Median seconds of one call of fn, from timed runs of CALLS back-to-back calls."""
    def calls():
        for _ in range(CALLS):
            fn()
    return cuda_time(calls, warmup=2, repeats=7) / CALLS


def rope_rows(name: str, T: int, copy: float) -> list[dict]:
    c = preset(name)
    Hq, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
    qkv = torch.randn(1, T, (Hq + 2 * Hkv) * D, device=DEVICE, dtype=DTYPE)
    angles = torch.rand(T, D // 2, device=DEVICE) * 6
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    positions = torch.arange(T, device=DEVICE) + 5
    caches = [[torch.zeros(1, Hkv, T + 5, D, device=DEVICE, dtype=DTYPE) for _ in range(2)] for _ in range(2)]
    bytes_moved = qkv.numel() * 2 + T * (Hq + 2 * Hkv) * D * 2 + 2 * T * D * 4   # qkv in; q, k, v out; tables
    old = launch_per_row(qkv, cos, sin, positions, *caches[0], Hq, Hkv)
    new = launch_row_blocks(qkv, cos, sin, positions, *caches[1], Hq, Hkv)
    same = torch.equal(old, new) and all(torch.equal(a, b) for a, b in zip(*caches))
    rows = []
    for kernel, launch, kv in (("rope per-row (old)", launch_per_row, caches[0]),
                               ("rope row-block (new)", launch_row_blocks, caches[1])):
        s = per_call(lambda: launch(qkv, cos, sin, positions, *kv, Hq, Hkv))
        rows.append({"shape": name, "rows": T, "kernel": kernel, "MB": bytes_moved / 1e6, "us": s * 1e6,
                     "GB/s": bytes_moved / s / 1e9, "of copy": bytes_moved / s / copy,
                     "same bits": "yes" if same else "NO"})
    return rows


def silu_rows(name: str, T: int, copy: float, compiled, tiles: bool) -> list[dict]:
    inter = preset(name).intermediate_size
    gate_up = torch.randn(T, 2 * inter, device=DEVICE, dtype=DTYPE) * 4
    bytes_moved = gate_up.numel() * 2 + T * inter * 2
    twin = silu_mul_reference(gate_up)
    cases = [("silu*up compiled (old)", compiled), ("silu*up kernel (new)", silu_mul_triton)]
    if tiles:
        cases += [(f"silu*up kernel {m}x{n} w{w}", lambda x, m=m, n=n, w=w: silu_mul_triton(x, m, n, w))
                  for m, n, w in TILES]
    rows = []
    for kernel, fn in cases:
        out = fn(gate_up)
        s = per_call(lambda: fn(gate_up))
        rows.append({"shape": name, "rows": T, "kernel": kernel, "MB": bytes_moved / 1e6, "us": s * 1e6,
                     "GB/s": bytes_moved / s / 1e9, "of copy": bytes_moved / s / copy,
                     "same bits": "yes" if torch.equal(out, twin) else
                     f"{(out != twin).float().mean().item():.1e} differ"})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiles", action="store_true", help="also time a few tile shapes of kernels.silu_mul")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("prefill_elementwise.py needs a CUDA device")
    torch.manual_seed(0)
    copy = copy_bandwidth(gigabytes=1.0)
    print(f"copy bandwidth {copy / 1e12:.2f} TB/s; 'same bits': rope new vs old, silu*up vs its eager twin\n")
    compiled = torch.compile(fused.silu_mul, dynamic=True, fullgraph=True)   # as engine.fused.cuda_kernels
    rows = []
    for name in SHAPES:
        for T in ROWS:
            rows += rope_rows(name, T, copy) + silu_rows(name, T, copy, compiled, args.tiles)
    print_table(rows)


if __name__ == "__main__":
    main()
