"""Attention kernels on one GPU: bandwidth against a same-run copy, SDPA, the upcast path, sparse.

    python bench/attention.py [--check] [--sweep] [--sections ...] [--tiny]

Layout: Llama-3-8B (32 query heads, 8 KV heads, D = 128, bf16), batch 1, cache of exactly S rows.
Bandwidth = KV bytes read (K and V, S rows) / time, over the copy bandwidth measured in this run
(torch copy of a 4 GiB tensor, read + write). Times from triton.testing.do_bench (L2 flushed each
rep); "graph" columns replay a CUDA graph of the whole step, which removes launch overhead.
--check first compares the Triton kernels with the references on CUDA (float64), graphs included,
and checks bitwise that each lane of a sparse verify step equals its own decode step.

--tiny (automatic without CUDA) runs every section at toy sizes on the CPU under TRITON_INTERPRET=1:
a crash test of the script before GPU time is spent. Its times mean nothing.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

TINY = "--tiny" in sys.argv or not torch.cuda.is_available()
if TINY:
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before any kernel module imports triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

from batchd.kernels import BlockKeySummary, decode_attention, score_tail_queries  # noqa: E402
from batchd.kernels.chunk_scoring.reference import score_tail_queries_reference  # noqa: E402
from batchd.kernels.decode_attention.reference import decode_attention_reference  # noqa: E402
from batchd.kernels.decode_attention.triton_kernel import decode_attention_triton, decode_tile, invariant_tile_rows  # noqa: E402
from batchd.kernels.sparse_attention import (  # noqa: E402
    keep_all_rows,
    select_blocks,
    sparse_attention,
    sparse_decode_attention,
)
from batchd.kernels.sparse_attention.reference import sparse_attention_reference  # noqa: E402

if TINY:   # same code paths, toy sizes (G = 4 and D = 128 as in Llama-3-8B)
    HQ, HKV, D = 8, 2, 128
    DEV = "cpu"
    CONTEXTS = (1024,)
    SPARSE_CONTEXTS = (1024,)
    SCORING_CONTEXTS = (1024,)
    TOP_K = 4
    COPY_BYTES = 1 << 20
else:
    HQ, HKV, D = 32, 8, 128
    DEV = "cuda"
    CONTEXTS = (8192, 32768, 65536, 131072)
    SPARSE_CONTEXTS = (32768, 65536, 131072)
    SCORING_CONTEXTS = (8192, 32768, 131072)
    TOP_K = 64        # sparse budget: 64 blocks of 64 rows = 4096 rows per lane and KV head group
    COPY_BYTES = 4 << 30
Q_ROWS = (1, 4, 8)
BACKEND = "triton" if TINY else "auto"   # the Triton kernels, interpreted under --tiny
BLOCK = 64            # sparse block rows (the engine's default, and the dense kernel's block)


def bench(fn) -> float:
    """Median milliseconds (one timed call under --tiny)."""
    if TINY:
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def bench_graph(fn) -> float:
    if TINY:
        return float("nan")
    try:
        return do_bench_cudagraph(fn, rep=60, return_mode="median")
    except Exception:
        traceback.print_exc()
        return float("nan")


def copy_bandwidth() -> float:
    """Bytes per second of a device copy, counting read and write."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    del src, dst
    return 2 * COPY_BYTES / (ms * 1e-3)


def make_inputs(S: int, QR: int, dtype=torch.bfloat16, B: int = 1, hq: int = HQ, hkv: int = HKV, d: int = D):
    g = torch.Generator(device=DEV).manual_seed(S + QR)
    q = torch.randn(B, hq, QR, d, device=DEV, dtype=dtype, generator=g)
    k = torch.randn(B, hkv, S, d, device=DEV, dtype=dtype, generator=g)
    v = torch.randn(B, hkv, S, d, device=DEV, dtype=dtype, generator=g)
    return q, k, v


def verify_mask(S: int, QR: int) -> torch.Tensor | None:
    """Lower-right causal mask [Q, S] for SDPA (None for one row: it sees everything)."""
    if QR == 1:
        return None
    return torch.arange(S, device=DEV)[None, :] <= (S - QR + torch.arange(QR, device=DEV))[:, None]


def sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def upcast_then_attend(q, k, v, mask):
    """What the seeds replaced: convert the cache to float32, then attend."""
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True).to(q.dtype)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


BOUNDS = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-4}


def check_dense() -> bool:
    ok = True
    bounds = BOUNDS
    # dense: GQA 1/3/4/8, Q 1..16, lengths at and inside block edges, per-batch lengths, D 64/128
    cases = [(2, 8, 8, 1, 64, 4096, [4096, 1000]), (1, 24, 8, 4, 128, 8192, [8192]),
             (2, 32, 8, 8, 128, 20000, [19999, 640]), (1, 32, 4, 16, 128, 3000, [2049]),
             (3, 12, 4, 5, 64, 777, [777, 64, 17])]
    if TINY:
        cases = [(1, 8, 2, 4, 128, 300, [300]), (2, 6, 2, 1, 64, 200, [200, 77])]
    for dtype in bounds:
        for B, hq, hkv, QR, d, S, lens in cases:
            q, k, v = make_inputs(S, QR, dtype, B, hq, hkv, d)
            sl = torch.tensor(lens, device=DEV)
            out = decode_attention(q, k, v, sl, backend=BACKEND)
            ref = decode_attention_reference(q, k, v, sl, compute_dtype=torch.float64)
            err = rel_err(out, ref)
            good = err < bounds[dtype]
            ok &= good
            print(f"CHECK dense {str(dtype)[6:]:8s} B={B} Hq={hq} Hkv={hkv} Q={QR:2d} D={d} lens={lens}: "
                  f"rel err {err:.1e} {'ok' if good else 'FAIL'}")
    return ok


def full_summary(k: torch.Tensor, length: int) -> BlockKeySummary:
    summary = BlockKeySummary.for_cache(k, block_size=BLOCK)
    summary.update(k, 0, length, backend=BACKEND)
    return summary


def check_sparse() -> bool:
    ok = True
    bounds = BOUNDS
    # summary: one Triton launch per update against the PyTorch twin, grown step by step
    S, steps = (1500, (1000, 1, 63, 4, 8, 300)) if TINY else (70000, (65000, 1, 63, 4, 8, 900))
    _, k, _ = make_inputs(S, 1)
    fast, slow = BlockKeySummary.for_cache(k), BlockKeySummary.for_cache(k)
    length = 0
    for step in steps:
        fast.update(k, length, length + step, backend=BACKEND)
        slow.update(k, length, length + step, backend="reference")
        length += step
    n = -(-length // 64)
    same = torch.equal(fast.kmin[:, :, :n], slow.kmin[:, :, :n]) and torch.equal(fast.kmax[:, :, :n], slow.kmax[:, :, :n])
    ok &= same
    print(f"CHECK summary update triton == reference: {'ok' if same else 'FAIL'}")
    # sparse: the kernel over the chosen blocks against the masked reference
    for dtype in (torch.bfloat16, torch.float16):
        for QR, S in (((1, 1024), (8, 900)) if TINY else ((1, 65536), (8, 40000))):
            q, k, v = make_inputs(S, QR, dtype)
            summary = full_summary(k, S)
            sl = torch.full((1,), S, device=DEV)
            chosen = select_blocks(q, summary, sl, top_k=TOP_K, backend=BACKEND)
            chosen_ref = select_blocks(q, summary, sl, top_k=TOP_K, backend="reference")
            agree = (chosen & chosen_ref).sum().item() / max(1, chosen_ref.sum().item())
            out = sparse_attention(q, k, v, sl, chosen, block_size=BLOCK, backend=BACKEND)
            ref = sparse_attention_reference(q, k, v, sl, chosen, BLOCK, 1 / math.sqrt(D), torch.float64)
            err = rel_err(out, ref)
            good = err < bounds[dtype] and chosen.sum(-1).max().item() <= TOP_K
            ok &= good
            print(f"CHECK sparse {str(dtype)[6:]:8s} Q={QR} S={S}: rel err {err:.1e}, "
                  f"{agree:.1%} of the reference selection's blocks chosen {'ok' if good else 'FAIL'}")
    return ok


def sparse_lane_steps(q16, k, v, summary, length, widths):
    """Sparse steps of Q rows ending at `length` for Q in widths, and the 16 one-row steps that their
    lanes stand for; float32 outputs, so that any difference in the partial sums shows (bf16 rounding
    of the output would hide most). -> (solo [16 outputs], {Q: output})"""
    from batchd.kernels.sparse_attention.triton_kernel import sparse_attention_triton

    def step(q, sl):
        chosen = select_blocks(q, summary, sl, top_k=TOP_K, backend="triton")
        return sparse_attention_triton(q, k, v, sl, chosen, BLOCK, D ** -0.5, out_dtype=torch.float32)

    solo = [step(q16[:, :, t:t + 1].contiguous(), torch.full((1,), length - 15 + t, device=DEV)) for t in range(16)]
    sl = torch.full((1,), length, device=DEV)
    return solo, {QR: step(q16[:, :, 16 - QR:].contiguous(), sl) for QR in widths}


def check_sparse_bitwise() -> bool:
    """Each lane of a sparse verify step equals its one-row decode step bit for bit (greedy output may
    not change with speculation on); every block kept equals the dense kernel bit for bit."""
    ok = True
    S = 1000 if TINY else 40000
    widths = (4, 8, 16)
    for dtype in (torch.bfloat16, torch.float16):
        q16, k, v = make_inputs(S + 64, 16, dtype)
        summary = full_summary(k, S)
        solo, steps = sparse_lane_steps(q16, k, v, summary, S, widths)
        for QR, out in steps.items():
            same = all(torch.equal(out[:, :, i:i + 1], solo[16 - QR + i]) for i in range(QR))
            ok &= same
            print(f"CHECK sparse {str(dtype)[6:]:8s} Q={QR:2d} S={S}: every lane == its decode step bitwise: "
                  f"{'ok' if same else 'FAIL'}")
        sl = torch.full((1,), S, device=DEV)
        n_blocks = summary.n_blocks
        everything = (torch.arange(n_blocks, device=DEV) * BLOCK < S).expand(1, HKV, 8, n_blocks).contiguous()
        q8 = q16[:, :, 8:].contiguous()
        same = torch.equal(sparse_attention(q8, k, v, sl, everything, block_size=BLOCK, backend=BACKEND),
                           decode_attention(q8, k, v, sl, backend=BACKEND))
        ok &= same
        print(f"CHECK sparse {str(dtype)[6:]:8s} Q= 8 S={S}: every block kept == dense kernel bitwise: "
              f"{'ok' if same else 'FAIL'}")
        # lanes on both sides of the rule: the first keep all their blocks, their decode steps run dense
        length = keep_all_rows(TOP_K, BLOCK) + 3
        step = sparse_decode_attention(q8, k, v, length, summary, top_k=TOP_K, backend=BACKEND)
        same = all(torch.equal(step[:, :, i:i + 1],
                               sparse_decode_attention(q8[:, :, i:i + 1].contiguous(), k, v, length - 7 + i, summary,
                                                       top_k=TOP_K, backend=BACKEND)) for i in range(8))
        ok &= same
        print(f"CHECK sparse {str(dtype)[6:]:8s} Q= 8 S={length}: lanes across the dense/sparse rule == their "
              f"decode steps bitwise: {'ok' if same else 'FAIL'}")
    return ok


def check_scoring() -> bool:
    ok = True
    # scoring pass
    for dtype in (torch.bfloat16, torch.float16):
        for S in ((300,) if TINY else (5000, 32768)):
            g = torch.Generator(device=DEV).manual_seed(S)
            qt = torch.randn(16, 8, 128, device=DEV, dtype=dtype, generator=g)
            kk = torch.randn(8, S, 128, device=DEV, dtype=dtype, generator=g)
            err = rel_err(score_tail_queries(qt, kk, backend=BACKEND),
                          score_tail_queries_reference(qt, kk, 128 ** -0.5, torch.float64))
            good = err < 1e-4
            ok &= good
            print(f"CHECK scoring {str(dtype)[6:]:8s} S={S}: rel err {err:.1e} {'ok' if good else 'FAIL'}")
    return ok


def capture(fn):
    """A CUDA graph of fn() after a warm-up on a side stream. -> (graph, output)"""
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def check_graph() -> bool:
    if TINY:
        print("CHECK graph: needs CUDA, skipped")
        return True
    ok = True
    # CUDA graph: capture once with a device seq_len, replay at other lengths
    q, k, v = make_inputs(16384, 4)
    sl = torch.full((1,), 16384, device=DEV)
    graph, out = capture(lambda: decode_attention(q, k, v, sl))
    for n in (16384, 9000, 65, 4):
        sl.fill_(n)
        graph.replay()
        err = rel_err(out, decode_attention_reference(q, k, v, sl, compute_dtype=torch.float64))
        good = err < 2e-2
        ok &= good
        print(f"CHECK graph replay seq_len={n}: rel err {err:.1e} {'ok' if good else 'FAIL'}")
    # the sparse step (selection and union attention) in a graph equals the eager step bitwise
    q, k, v = make_inputs(70000, 8)
    summary = full_summary(k, 70000)
    sl = torch.full((1,), 70000, device=DEV)

    def sparse_step():
        return sparse_attention(q, k, v, sl, select_blocks(q, summary, sl, top_k=TOP_K), block_size=BLOCK)

    graph, out = capture(sparse_step)
    for n in (70000, 40001, 9000):
        sl.fill_(n)
        graph.replay()
        same = torch.equal(out, sparse_step())
        ok &= same
        print(f"CHECK sparse graph replay Q=8 seq_len={n} == eager bitwise: {'ok' if same else 'FAIL'}")
    return ok


def sweep(S: int = 65536, hq: int = HQ, hkv: int = HKV, copy_bw: float | None = None) -> None:
    """Time decode_attention_triton configurations at S rows for a (hq, hkv) head layout; prints
    the default configuration and the three best per Q (and, for Q = 1, the decode tile of 64 rows)."""
    kv_bytes = 2 * hkv * S * D * 2
    for QR in (1, 8):
        q, k, v = make_inputs(S, QR, hq=hq, hkv=hkv)
        sl = torch.full((1,), S, device=DEV)

        def run(block_n, warps, stages, splits, block_m=None):
            fn = lambda: decode_attention_triton(q, k, v, sl, D ** -0.5, num_splits=splits,  # noqa: E731
                                                 block_n=block_n, num_warps=warps, num_stages=stages,
                                                 block_m=block_m)
            try:
                return bench_graph(fn)
            except Exception as e:  # out of shared memory or registers for this configuration
                print(f"SWEEP Q={QR} block_n={block_n} warps={warps} stages={stages}: {type(e).__name__}")
                return float("inf")

        def show(label, ms, bn, w, st, sp, bm=None):
            share = f" {kv_bytes / ms / copy_bw * 1e3:5.1%} of copy" if copy_bw else ""
            print(f"SWEEP {hq}/{hkv} heads S={S} Q={QR:2d} {label:8s} {ms * 1e3:7.1f} us {kv_bytes / ms / 1e6:6.0f} GB/s"
                  f"{share}  block_n={bn} warps={w} stages={st} splits={sp or 'default'} block_m={bm or 'invariant'}")

        G = hq // hkv
        invariant = invariant_tile_rows(G)
        show("G*16", run(64, None, 2, None, block_m=invariant), 64, "auto", 2, None, invariant)   # the tile before the fitted rows
        tile = decode_tile(G)
        show("table", run(None, None, None, None), tile.block_n, tile.num_warps or "auto", tile.num_stages, None,
             "fit" if tile.fit_rows else None)
        results = [(run(bn, w, st, None), bn, w, st, None)
                   for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
        _, bn, w, st, _ = min(results)
        results += [(run(bn, w, st, sp), bn, w, st, sp) for sp in (16, 33, 66, 132, 264)]
        results.sort(key=lambda r: r[0])
        for ms, bn, w, st, sp in results[:3]:
            show("best", ms, bn, w, st, sp)
        if QR == 1 and G <= 8:
            _, bn, w, st, sp = results[0]
            show("tile 64", run(bn, 4, st, sp, block_m=64), bn, 4, st, sp, 64)


def sparse_breakdown(q, k, v, sl, summary, selected) -> str:
    """Graph-replay time of each stage of one sparse step (eager under --tiny)."""
    from batchd.kernels.sparse_attention.triton_kernel import (
        block_scores_triton,
        select_from_scores_triton,
        sparse_attention_triton,
    )

    S, QR = k.shape[2], q.shape[2]
    scores = block_scores_triton(q, summary.kmin, summary.kmax, sl, BLOCK, 2)
    keep_all = keep_all_rows(TOP_K, BLOCK)
    stages = {
        "update": lambda: summary.update(k, S - QR, S, backend=BACKEND),
        "score": lambda: block_scores_triton(q, summary.kmin, summary.kmax, sl, BLOCK, 2),
        "select": lambda: select_from_scores_triton(scores, sl, TOP_K, keep_all),
        "attend+merge": lambda: sparse_attention_triton(q, k, v, sl, selected, BLOCK, D ** -0.5),
    }
    timer = bench if TINY else bench_graph
    return ", ".join(f"{name} {timer(fn) * 1e3:.1f}" for name, fn in stages.items())


def sparse_sweep() -> None:
    """Time the union attention kernel's launch knobs at the largest context, q = 8 (fixed selection).
    Splits other than the default keep lanes equal to their decode steps but no longer equal to the
    dense kernel where a lane keeps all its blocks."""
    from batchd.kernels.sparse_attention.triton_kernel import sparse_attention_triton

    S = SPARSE_CONTEXTS[-1]
    q, k, v = make_inputs(S, 8)
    sl = torch.full((1,), S, device=DEV)
    selected = select_blocks(q, full_summary(k, S), sl, top_k=TOP_K, backend=BACKEND)
    results = []
    for splits in (None, 132, 264):
        for warps in (4, 8):
            for stages in (2, 3, 4):
                fn = lambda: sparse_attention_triton(q, k, v, sl, selected, BLOCK, D ** -0.5,  # noqa: E731
                                                     num_splits=splits, num_warps=warps, num_stages=stages)
                try:
                    results.append((bench_graph(fn), splits, warps, stages))
                except Exception as e:  # out of shared memory or registers for this configuration
                    print(f"SWEEP sparse splits={splits} warps={warps} stages={stages}: {type(e).__name__}")
    results.sort(key=lambda r: r[0])
    for ms, splits, warps, stages in results[:5]:
        print(f"SWEEP sparse Q=8 {S // 1024}K attend+merge {ms * 1e3:7.1f} us  splits={splits or 'default'} "
              f"warps={warps} stages={stages}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="compare with the references on CUDA first")
    parser.add_argument("--sweep", action="store_true", help="time kernel configurations at 64K")
    parser.add_argument("--sections", default="dense,sparse,scoring",
                        help="comma-separated tables: dense, sparse, scoring; checks: check-dense, "
                             "check-sparse, check-sparse-bitwise, check-scoring, check-graph")
    parser.add_argument("--sweep-layout", help="q,kv heads: sweep that head layout (12,2 is Qwen2.5-1.5B's)")
    parser.add_argument("--sweep-contexts", default="32768", help="contexts for --sweep-layout, comma-separated")
    parser.add_argument("--tiny", action="store_true",
                        help="toy sizes on the CPU under TRITON_INTERPRET=1 (automatic without CUDA)")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    if args.check:
        sections |= {"check-dense", "check-sparse", "check-sparse-bitwise", "check-scoring", "check-graph"}
    device = "CPU, Triton interpreter, toy sizes (--tiny)" if TINY else torch.cuda.get_device_name()
    print(device, f"torch {torch.__version__} triton {triton.__version__}")
    checks = {"check-dense": check_dense, "check-sparse": check_sparse, "check-sparse-bitwise": check_sparse_bitwise,
              "check-scoring": check_scoring, "check-graph": check_graph}
    failed = []
    for name, section in checks.items():
        if name in sections:
            try:
                if not section():
                    failed.append(name)
            except Exception:  # report and go on to the tables: device time is scarce
                traceback.print_exc()
                failed.append(name)
    if failed or any(name in sections for name in checks):
        print("CHECK", f"FAILURES in {failed}" if failed else "all ok")
    if args.sweep:
        for section in (sweep, sparse_sweep):
            try:
                section()
            except Exception:
                traceback.print_exc()
    if args.sweep_layout:
        hq, hkv = (int(v) for v in args.sweep_layout.split(","))
        bw = copy_bandwidth()
        for S in (int(v) for v in args.sweep_contexts.split(",")):
            try:
                sweep(S, hq, hkv, bw)
            except Exception:
                traceback.print_exc()

    copy_bw = copy_bandwidth()
    print(f"copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s")
    if "dense" in sections:
        dense_table(copy_bw)
    if "sparse" in sections:
        sparse_table()
    if "scoring" in sections:
        scoring_table(copy_bw)


def dense_table(copy_bw: float) -> None:
    print(f"\ndense decode/verify attention, {HQ} q heads, {HKV} KV heads, D={D}, bf16, B=1 (times in us)")
    print("kernel: eager call; graph: the same call replayed from a CUDA graph (no launch gaps); "
          "%copy from the graph time")
    print(f"{'ctx':>6} {'q':>2} | {'kernel':>7} {'graph':>7} {'GB/s':>5} {'%copy':>5} | {'sdpa':>7} {'upcast':>7} | "
          f"{'vs sdpa':>7} {'vs upcast':>9}")
    for S in CONTEXTS:
        for QR in Q_ROWS:
            q, k, v = make_inputs(S, QR)
            sl = torch.full((1,), S, device=DEV)
            mask = verify_mask(S, QR)
            t_kernel = bench(lambda: decode_attention(q, k, v, sl, backend=BACKEND))
            t_graph = bench_graph(lambda: decode_attention(q, k, v, sl, backend=BACKEND))
            t_sdpa = bench(lambda: sdpa(q, k, v, mask))
            t_up = bench(lambda: upcast_then_attend(q, k, v, mask))
            bw = 2 * HKV * S * D * 2 / (t_graph * 1e-3)
            print(f"{S // 1024:>5}K {QR:>2} | {t_kernel * 1e3:7.1f} {t_graph * 1e3:7.1f} {bw / 1e9:5.0f} "
                  f"{100 * bw / copy_bw:4.0f}% | "
                  f"{t_sdpa * 1e3:7.1f} {t_up * 1e3:7.1f} | {t_sdpa / t_kernel:6.2f}x {t_up / t_kernel:8.2f}x")
            del q, k, v


def sparse_table() -> None:
    print(f"\nsparse (top_k={TOP_K} blocks of {BLOCK}, summary update + selection included) vs dense kernel (us)")
    print("union: blocks read per KV head (the union of the lanes' choices, each read once) / q*top_k; "
          "the bench's random queries choose nearly independent blocks, so the union is close to q*top_k")
    print(f"{'ctx':>6} {'q':>2} | {'dense':>7} {'sparse':>7} {'speedup':>7} | {'dense graph':>11} {'sparse graph':>12} "
          f"{'speedup':>7} | {'union':>11}")
    breakdowns = []
    for S in SPARSE_CONTEXTS:
        for QR in Q_ROWS:
            q, k, v = make_inputs(S, QR)
            sl = torch.full((1,), S, device=DEV)
            summary = full_summary(k, S)

            def sparse_step():
                summary.update(k, S - QR, S, backend=BACKEND)          # the step's new rows
                return sparse_decode_attention(q, k, v, sl, summary, top_k=TOP_K, min_seq_len=S, backend=BACKEND)

            def dense_step():
                return decode_attention(q, k, v, sl, backend=BACKEND)

            t_d, t_s = bench(dense_step), bench(sparse_step)
            g_d, g_s = bench_graph(dense_step), bench_graph(sparse_step)
            selected = select_blocks(q, summary, sl, top_k=TOP_K, backend=BACKEND)
            union = selected.any(dim=2).sum(-1).float().mean().item()          # [B, Hkv] -> mean
            print(f"{S // 1024:>5}K {QR:>2} | {t_d * 1e3:7.1f} {t_s * 1e3:7.1f} {t_d / t_s:6.2f}x | "
                  f"{g_d * 1e3:11.1f} {g_s * 1e3:12.1f} {g_d / g_s:6.2f}x | {union:5.0f}/{QR * TOP_K:<5d}")
            if S == SPARSE_CONTEXTS[-1]:
                breakdowns.append(f"{S // 1024:>5}K {QR:>2} | dense {g_d * 1e3:.1f}, "
                                  + sparse_breakdown(q, k, v, sl, summary, selected))
            del q, k, v, summary
    print("sparse stages (graph us, each stage replayed alone):")
    for line in breakdowns:
        print(line)


def scoring_table(copy_bw: float) -> None:
    print("\nPFlash scoring pass, Qwen3-0.6B drafter heads (16 q, 8 KV, D=128), T=8, bf16, one layer (us)")
    print(f"{'ctx':>6} | {'kernel':>7} {'%copy':>5} | {'reference':>9}")
    for S in SCORING_CONTEXTS:
        qt = torch.randn(16, 8, 128, device=DEV, dtype=torch.bfloat16)
        kk = torch.randn(8, S, 128, device=DEV, dtype=torch.bfloat16)
        t = bench(lambda: score_tail_queries(qt, kk, backend=BACKEND))
        t_ref = bench(lambda: score_tail_queries_reference(qt, kk, 128 ** -0.5))
        bw = 2 * kk.numel() * 2 / (t * 1e-3)                   # two passes over K
        print(f"{S // 1024:>5}K | {t * 1e3:7.1f} {100 * bw / copy_bw:4.0f}% | {t_ref * 1e3:9.1f}")


if __name__ == "__main__":
    main()
