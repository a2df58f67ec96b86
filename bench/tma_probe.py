"""Do weight tiles stream faster through the Hopper TMA engine than through cp.async?

    python bench/tma_probe.py [--shapes qkv,o,gate_up] [--repeat R]

small_linear loads its weight tiles with pointer loads, which Triton pipelines as cp.async
(LDGSTS: every thread copies 16 bytes at a time, then waits on its group). On sm_90 a tensor
descriptor load (`desc.load`) becomes one TMA bulk copy per tile, issued by one thread and
completed on an mbarrier. This probe runs the same k loop both ways: one program per BLOCK_N
weight rows, out^T[BLOCK_N, 16] += W[BLOCK_N, BLOCK_K] @ x^T[BLOCK_K, 16] (x's 16 rows, M = 1 of
them real), float32 accumulation, PDL between calls, a chain of calls in one CUDA graph, each call
on its own weight copy so that every call streams from HBM. It prints us per call, the weight
bytes over that time, and small_linear (its table config, and for qkv a few other tiles) on the
same chain for reference.
Both loads give the same tile values, so the same tl.dot gives the same bits (checked per row).

H200, stop 16: TMA 0.5-1.2 us slower per call on Qwen2.5-1.5B's qkv and o (4-8 KB tiles), within
2% on gate_up (kernels/small_matmul/NOTES.md, "Stop 16"). small_linear keeps cp.async.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from bench.common import copy_bandwidth, graph_replay_time, print_table  # noqa: E402
from batchd.kernels._backend import launch_options  # noqa: E402
from batchd.kernels.small_matmul.triton_kernel import SmallLinearConfig, choose_config, small_linear_triton  # noqa: E402

BLOCK_M = tl.constexpr(16)


@triton.jit
def _tile_gemv(X, W, WDesc, Out, M, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               TMA: tl.constexpr, STAGES: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    n0 = pid * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        if TMA:
            w = WDesc.load([n0, k0])                                               # [BLOCK_N, BLOCK_K]
        else:
            w = tl.load(W + offs_n[:, None] * K + (k0 + offs_k)[None, :])
        x = tl.load(X + offs_m[None, :] * K + (k0 + offs_k)[:, None], mask=offs_m[None, :] < M, other=0.0)
        acc = tl.dot(w, x, acc)                                                    # [BLOCK_N, BLOCK_M]
    tl.store(Out + offs_m[None, :] * N + offs_n[:, None], acc.to(Out.dtype.element_ty), mask=offs_m[None, :] < M)


SHAPES = {  # name: (N, K, [(block_n, block_k, stages, warps), ...])  Qwen2.5-1.5B's decode weights
    "qkv": (2048, 1536, [(16, 128, 4, 4), (16, 128, 6, 4), (16, 256, 3, 4), (16, 256, 4, 4), (16, 512, 2, 4),
                         (16, 512, 3, 4), (32, 128, 4, 4)]),
    "o": (1536, 1536, [(16, 128, 4, 4), (16, 256, 3, 4)]),
    "gate_up": (17920, 1536, [(128, 128, 3, 4), (128, 64, 6, 4), (64, 128, 4, 4), (128, 128, 4, 8)]),
}


# small_linear itself (its fused paths off) at other tiles, beside the table's
SMALL_LINEAR_EXTRA = {"qkv": [(16, 256, 4, 4), (16, 512, 2, 4), (16, 512, 3, 4)]}


def run_shape(name: str, bytes_per_chain: float) -> list[dict]:
    N, K, tiles = SHAPES[name]
    copies = max(2, int(bytes_per_chain // (N * K * 2)))
    ws = [(torch.randn(N, K, device="cuda") / K ** 0.5).to(torch.bfloat16) for _ in range(copies)]
    x = torch.randn(1, K, device="cuda").to(torch.bfloat16)
    outs = [torch.empty(1, N, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    ref = (x.float() @ ws[0].float().T)
    rows = []
    for bn, bk, stages, warps in tiles:
        descs = [TensorDescriptor.from_tensor(w, [bn, bk]) for w in ws]
        bits = {}
        for tma in (False, True):
            def chain(tma=tma):
                for i in range(copies):
                    _tile_gemv[(N // bn,)](x, ws[i], descs[i], outs[i], 1, N, K=K, BLOCK_N=bn, BLOCK_K=bk, TMA=tma,
                                           STAGES=stages, USE_PDL=True, num_warps=warps, **launch_options(True))
            chain()
            torch.cuda.synchronize()
            bits[tma] = outs[0].clone()
            err = ((outs[0].float() - ref).abs().max() / ref.abs().max()).item()
            t = graph_replay_time(chain) / copies
            rows.append(dict(weight=name, tile=f"{bn}x{bk} s{stages} w{warps}", load="TMA" if tma else "cp.async",
                             us=round(t * 1e6, 2), tb_s=round(N * K * 2 / t / 1e12, 2), err=f"{err:.0e}",
                             same_bits="" if not tma else str(torch.equal(bits[True], bits[False]))))
            print(rows[-1], flush=True)
    table = choose_config(N, K, torch.bfloat16, x.device)
    for label, cfg in [("table", table)] + [(f"{bn}x{bk} s{st}", SmallLinearConfig(bn, bk, 1, num_warps=w, num_stages=st))
                                            for bn, bk, st, w in SMALL_LINEAR_EXTRA.get(name, [])]:
        def small_linear_chain(cfg=cfg):
            for i in range(copies):
                small_linear_triton(x, ws[i], None, config=cfg)
        t = graph_replay_time(small_linear_chain) / copies
        rows.append(dict(weight=name, tile=f"small_linear {label}", load="cp.async", us=round(t * 1e6, 2),
                         tb_s=round(N * K * 2 / t / 1e12, 2), err="", same_bits=""))
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qkv,o,gate_up")
    ap.add_argument("--chain-mb", type=float, default=400.0, help="weight bytes per chain (well past the L2)")
    args = ap.parse_args()
    bw = copy_bandwidth()
    rows = []
    for name in args.shapes.split(","):
        rows += run_shape(name, args.chain_mb * 1e6)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    print_table(rows)


if __name__ == "__main__":
    main()
