"""Does streaming gate_up's weights during the attention half pay? A probe for a persistent layer.

    python bench/overlap_probe.py

At batch 1 the Qwen2.5-1.5B attention half (qkv, attention split and merge, o) runs some 13 us
while moving 11 MB: the HBM idles. A persistent layer kernel could let gate_up's programs fetch
their first weight tiles then, and finish the rest once o's output is there. This probe measures
that without writing the persistent kernel. One CUDA graph per variant:

  main stream:  a chain of four latency-bound launches standing in for the attention half (qkv
                2048x1536, two 512x1536 projections, o 1536x1536; PDL between them), then a
                one-program launch that publishes this replay's epoch in a flag;
  gate_up:      17920x1536 in BLOCK_N-row tiles. Each program loads its first PRE weight tiles
                into registers, spins until the flag holds this replay's epoch, then reads x
                (the chain's output) and runs its k loop.

"serial" launches gate_up on the main stream after the flag (it finds the flag set at once).
"overlap" launches it on a second stream at the start of the graph, so its programs are resident
and fetching during the chain. overlap - serial is what the overlap saves (negative) or costs;
PRE = 0 separates the cost of resident spinning programs from the gain of early tiles. The chain
alone and gate_up alone (serial) are timed too.

A spinning kernel must fit in one wave: when some of its programs still wait for a slot, the
chain's launches never run, and the resident ones then spin forever (tile_preloads). The spin gives up after
MAX_SPINS polls and counts the programs that did, so a variant that deadlocks ends with a count.

H200, stop 16: overlap saved at most 0.9 us against the same kernel serial and never beat the
plain serial kernel (PRE = 0); kernels/small_matmul/NOTES.md, "Stop 16".
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench.common import copy_bandwidth, graph_replay_time, print_table  # noqa: E402
from batchd.kernels.small_matmul.triton_kernel import SmallLinearConfig, small_linear_triton  # noqa: E402

BLOCK_M = tl.constexpr(16)


@triton.jit
def _bump(Epoch):
    tl.store(Epoch, tl.load(Epoch) + 1)


@triton.jit
def _publish(Flag, Epoch):
    tl.atomic_xchg(Flag, tl.load(Epoch), sem="release")


@triton.jit
def _dot_step(acc, w, X, k0, offs_k, offs_m):
    x = tl.load(X + offs_m[None, :] * 0 + (k0 + offs_k)[:, None], mask=offs_m[None, :] < 1, other=0.0)
    return tl.dot(w, x, acc)                                                  # [BLOCK_N, BLOCK_M]


@triton.jit
def _staged_linear(X, W, Out, Flag, Epoch, Stuck, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRE: tl.constexpr, STAGES: tl.constexpr, MAX_SPINS: tl.constexpr = 1 << 16):
    """out[n] = sum_k W[n, k] x[k] (M = 1 of 16 tile rows), the first PRE weight tiles loaded before
    the spin on Flag; k steps in increasing order either way. A program that spins MAX_SPINS times
    gives up (so a probe that would deadlock ends) and counts itself in Stuck."""
    tl.static_assert(PRE <= 4)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    w_ptrs = W + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    if PRE >= 1:
        w0 = tl.load(w_ptrs)
    if PRE >= 2:
        w1 = tl.load(w_ptrs + BLOCK_K)
    if PRE >= 3:
        w2 = tl.load(w_ptrs + 2 * BLOCK_K)
    if PRE >= 4:
        w3 = tl.load(w_ptrs + 3 * BLOCK_K)
    target = tl.load(Epoch, volatile=True)
    spins = 0
    while (tl.atomic_add(Flag, 0, sem="acquire") < target) & (spins < MAX_SPINS):
        spins += 1
    if spins >= MAX_SPINS:
        tl.atomic_add(Stuck, 1)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if PRE >= 1:
        acc = _dot_step(acc, w0, X, 0, offs_k, offs_m)
    if PRE >= 2:
        acc = _dot_step(acc, w1, X, BLOCK_K, offs_k, offs_m)
    if PRE >= 3:
        acc = _dot_step(acc, w2, X, 2 * BLOCK_K, offs_k, offs_m)
    if PRE >= 4:
        acc = _dot_step(acc, w3, X, 3 * BLOCK_K, offs_k, offs_m)
    for k0 in tl.range(PRE * BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        acc = _dot_step(acc, tl.load(w_ptrs + k0), X, k0, offs_k, offs_m)
    tl.store(Out + offs_n[:, None] + offs_m[None, :] * 0, acc.to(Out.dtype.element_ty), mask=offs_m[None, :] < 1)


HIDDEN, GATE_UP = 1536, 17920
CHAIN = [(2048, SmallLinearConfig(16, 128, 1, num_warps=4, num_stages=4)),   # qkv's table tile
         (512, SmallLinearConfig(16, 128, 1, num_warps=4, num_stages=4)),
         (512, SmallLinearConfig(16, 128, 1, num_warps=4, num_stages=4)),
         (1536, SmallLinearConfig(16, 128, 1, num_warps=4, num_stages=4))]   # o as tiles (56 registers)
TILES = [(128, 64, 4, 4), (128, 128, 8, 3)]    # gate_up (block_n, block_k, warps, stages)
COPIES = 8                                     # weight sets cycled by replays: 8 x 70 MB, past the L2


def tile_preloads(tile) -> tuple[int, ...]:
    """PRE values probed for a tile. 128x128 on 8 warps takes 108 KB of shared memory at PRE = 0
    (two programs per SM, all 140 resident) but 144 KB at PRE = 2 or 4 (compiled for sm_90): one
    program per SM, so 8 of its 140 programs wait for a slot; the chain's launches then never run
    (they seem to queue behind those 8), and the resident programs spin until MAX_SPINS (H200: 1152 give-ups in one timing at
    PRE = 2 and at PRE = 4). Only its PRE = 0 is probed."""
    return (0, 2, 4) if tile[2] == 4 else (0,)



def main() -> None:
    dev = torch.device("cuda")
    bw = copy_bandwidth()
    sets = []
    for _ in range(COPIES):
        chain_w = [(torch.randn(n, HIDDEN, device=dev) / HIDDEN ** 0.5).to(torch.bfloat16) for n, _ in CHAIN]
        gu_w = (torch.randn(GATE_UP, HIDDEN, device=dev) / HIDDEN ** 0.5).to(torch.bfloat16)
        sets.append((chain_w, gu_w))
    x0 = torch.randn(1, HIDDEN, device=dev).to(torch.bfloat16)
    o_out = torch.empty(1, HIDDEN, device=dev, dtype=torch.bfloat16)
    gu_out = torch.empty(GATE_UP, device=dev, dtype=torch.bfloat16)
    flag = torch.zeros(1, device=dev, dtype=torch.int32)
    epoch = torch.zeros(1, device=dev, dtype=torch.int32)
    stuck = torch.zeros(1, device=dev, dtype=torch.int32)
    side = torch.cuda.Stream()

    def chain(chain_w):
        x = x0
        for (n, cfg), w in zip(CHAIN, chain_w):
            x = small_linear_triton(x if x.shape[1] == HIDDEN else x0, w, None, config=cfg)
        o_out.copy_(x)           # the o stand-in's output: gate_up's x

    def gate_up(gu_w, tile, pre):
        bn, bk, warps, stages = tile
        _staged_linear[(GATE_UP // bn,)](o_out, gu_w, gu_out, flag, epoch, stuck, GATE_UP, K=HIDDEN, BLOCK_N=bn,
                                         BLOCK_K=bk, PRE=pre, STAGES=stages, num_warps=warps)

    def step(mode, tile=None, pre=0):
        def run():
            for chain_w, gu_w in sets:
                _bump[(1,)](epoch)
                if mode == "overlap":
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        gate_up(gu_w, tile, pre)
                if mode != "gate_up only":
                    chain(chain_w)
                _publish[(1,)](flag, epoch)
                if mode in ("serial", "gate_up only"):
                    gate_up(gu_w, tile, pre)
                if mode == "overlap":
                    torch.cuda.current_stream().wait_stream(side)
        return run

    rows = []

    def measure(label, mode, tile=None, pre=0):
        print(f"measuring {label}", file=sys.stderr, flush=True)
        stuck.zero_()
        gu_out.zero_()
        t = graph_replay_time(step(mode, tile, pre)) / COPIES
        print(f"  {t * 1e6:.2f} us, {int(stuck.item())} programs gave up", file=sys.stderr, flush=True)
        err = float("nan")
        if tile is not None:       # the last replay's gate_up ran on the last weight set, after its chain
            ref = (sets[-1][1].float() @ o_out.float().T).squeeze(1)
            err = ((gu_out.float() - ref).abs().max() / ref.abs().max()).item()
        return t, int(stuck.item()), err

    chain_only, _, _ = measure("chain + publish only", "chain only")
    for tile in TILES:
        name = f"{tile[0]}x{tile[1]} w{tile[2]} s{tile[3]}"
        alone, _, _ = measure(f"{name}, alone", "gate_up only", tile, 0)
        for pre in tile_preloads(tile):
            serial, _, serial_err = measure(f"{name} pre {pre}: serial", "serial", tile, pre)
            overlap, gave_up, overlap_err = measure(f"{name} pre {pre}: overlap", "overlap", tile, pre)
            early_mb = GATE_UP * HIDDEN * 2 * pre * tile[1] / HIDDEN / 1e6
            rows.append({"gate_up tile": name, "alone us": round(alone * 1e6, 2), "pre": pre,
                         "early MB": round(early_mb, 1), "early MB at copy bw, us": round(early_mb * 1e12 / bw, 2),
                         "serial us": round(serial * 1e6, 2), "overlap us": round(overlap * 1e6, 2),
                         "overlap - serial": round((overlap - serial) * 1e6, 2), "programs gave up": gave_up,
                         "rel err serial / overlap": f"{serial_err:.0e} / {overlap_err:.0e}"})
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; chain + publish alone {chain_only * 1e6:.2f} us")
    print_table(rows)


if __name__ == "__main__":
    main()
