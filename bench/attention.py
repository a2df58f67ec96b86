"""Attention kernels on one GPU: bandwidth against a same-run copy, SDPA, the upcast path, sparse.

    python bench/attention.py [--check] [--sweep]

Layout: Llama-3-8B (32 query heads, 8 KV heads, D = 128, bf16), batch 1, cache of exactly S rows.
Bandwidth = KV bytes read (K and V, S rows) / time, over the copy bandwidth measured in this run
(torch copy of a 4 GiB tensor, read + write). Times from triton.testing.do_bench (L2 flushed each
rep); "graph" columns replay a CUDA graph of the whole step, which removes launch overhead.
--check first compares the Triton kernels with the references on CUDA (float64), graphs included.
"""
from __future__ import annotations

import argparse
import math
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

from kernels import BlockKeySummary, decode_attention, score_tail_queries  # noqa: E402
from kernels.chunk_scoring.reference import score_tail_queries_reference  # noqa: E402
from kernels.decode_attention.reference import decode_attention_reference  # noqa: E402
from kernels.decode_attention.triton_kernel import decode_attention_triton  # noqa: E402
from kernels.sparse_attention import select_blocks, sparse_attention, sparse_decode_attention  # noqa: E402
from kernels.sparse_attention.reference import sparse_attention_reference  # noqa: E402

HQ, HKV, D = 32, 8, 128
DEV = "cuda"
CONTEXTS = (8192, 32768, 65536, 131072)
Q_ROWS = (1, 4, 8)
SPARSE_CONTEXTS = (65536, 131072)
SCORING_CONTEXTS = (8192, 32768, 131072)
TOP_K = 64            # sparse budget: 64 blocks of 64 rows = 4096 rows per lane and KV head group


def bench(fn) -> float:
    """Median milliseconds."""
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def bench_graph(fn) -> float:
    try:
        return do_bench_cudagraph(fn, rep=60, return_mode="median")
    except Exception:
        traceback.print_exc()
        return float("nan")


def copy_bandwidth() -> float:
    """Bytes per second of a device copy, counting read and write."""
    src = torch.empty(4 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    del src, dst
    return 2 * (4 << 30) / (ms * 1e-3)


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
    for dtype in bounds:
        for B, hq, hkv, QR, d, S, lens in cases:
            q, k, v = make_inputs(S, QR, dtype, B, hq, hkv, d)
            sl = torch.tensor(lens, device=DEV)
            out = decode_attention(q, k, v, sl)
            ref = decode_attention_reference(q, k, v, sl, compute_dtype=torch.float64)
            err = rel_err(out, ref)
            good = err < bounds[dtype]
            ok &= good
            print(f"CHECK dense {str(dtype)[6:]:8s} B={B} Hq={hq} Hkv={hkv} Q={QR:2d} D={d} lens={lens}: "
                  f"rel err {err:.1e} {'ok' if good else 'FAIL'}")
    return ok


def check_sparse() -> bool:
    ok = True
    bounds = BOUNDS
    # summary: one Triton launch per update against the PyTorch twin, grown step by step
    _, k, _ = make_inputs(70000, 1)
    fast, slow = BlockKeySummary.for_cache(k), BlockKeySummary.for_cache(k)
    length = 0
    for step in (65000, 1, 63, 4, 8, 900):
        fast.update(k, length, length + step)
        slow.update(k, length, length + step, backend="reference")
        length += step
    n = -(-length // 64)
    same = torch.equal(fast.kmin[:, :, :n], slow.kmin[:, :, :n]) and torch.equal(fast.kmax[:, :, :n], slow.kmax[:, :, :n])
    ok &= same
    print(f"CHECK summary update triton == reference: {'ok' if same else 'FAIL'}")
    # sparse: the kernel over the selected blocks against the masked reference
    for dtype in (torch.bfloat16, torch.float16):
        for QR, S in ((1, 65536), (8, 40000)):
            q, k, v = make_inputs(S, QR, dtype)
            summary = BlockKeySummary.for_cache(k)
            summary.update(k, 0, S)
            sl = torch.full((1,), S, device=DEV)
            ids = select_blocks(q, summary, sl, top_k=TOP_K)
            ids_ref = select_blocks(q, summary, sl, top_k=TOP_K, backend="reference")
            same_sel = (torch.sort(ids, -1).values == torch.sort(ids_ref, -1).values).float().mean().item()
            out = sparse_attention(q, k, v, sl, ids, block_size=64)
            ref = sparse_attention_reference(q, k, v, sl, ids, 64, 1 / math.sqrt(D), torch.float64)
            err = rel_err(out, ref)
            good = err < bounds[dtype]
            ok &= good
            print(f"CHECK sparse {str(dtype)[6:]:8s} Q={QR} S={S}: rel err {err:.1e}, "
                  f"selection agrees with reference on {same_sel:.1%} of ids {'ok' if good else 'FAIL'}")
    return ok


def check_scoring() -> bool:
    ok = True
    # scoring pass
    for dtype in (torch.bfloat16, torch.float16):
        for S in (5000, 32768):
            g = torch.Generator(device=DEV).manual_seed(S)
            qt = torch.randn(16, 8, 128, device=DEV, dtype=dtype, generator=g)
            kk = torch.randn(8, S, 128, device=DEV, dtype=dtype, generator=g)
            err = rel_err(score_tail_queries(qt, kk), score_tail_queries_reference(qt, kk, 128 ** -0.5, torch.float64))
            good = err < 1e-4
            ok &= good
            print(f"CHECK scoring {str(dtype)[6:]:8s} S={S}: rel err {err:.1e} {'ok' if good else 'FAIL'}")
    return ok


def check_graph() -> bool:
    ok = True
    # CUDA graph: capture once with a device seq_len, replay at other lengths
    q, k, v = make_inputs(16384, 4)
    sl = torch.full((1,), 16384, device=DEV)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        decode_attention(q, k, v, sl)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, sl)
    for n in (16384, 9000, 65, 4):
        sl.fill_(n)
        graph.replay()
        err = rel_err(out, decode_attention_reference(q, k, v, sl, compute_dtype=torch.float64))
        good = err < 2e-2
        ok &= good
        print(f"CHECK graph replay seq_len={n}: rel err {err:.1e} {'ok' if good else 'FAIL'}")
    return ok


def sweep() -> None:
    """Time decode_attention_triton configurations at 64K; prints the three best per Q."""
    S = 65536
    kv_bytes = 2 * HKV * S * D * 2
    for QR in (1, 8):
        q, k, v = make_inputs(S, QR)
        sl = torch.full((1,), S, device=DEV)

        def run(block_n, warps, stages, splits):
            fn = lambda: decode_attention_triton(q, k, v, sl, D ** -0.5, num_splits=splits,  # noqa: E731
                                                 block_n=block_n, num_warps=warps, num_stages=stages)
            try:
                return bench_graph(fn)
            except Exception as e:  # out of shared memory or registers for this configuration
                print(f"SWEEP Q={QR} block_n={block_n} warps={warps} stages={stages}: {type(e).__name__}")
                return float("inf")

        results = [(run(bn, w, st, None), bn, w, st, None)
                   for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
        _, bn, w, st, _ = min(results)
        results += [(run(bn, w, st, sp), bn, w, st, sp) for sp in (16, 33, 66, 132)]
        results.sort(key=lambda r: r[0])
        for ms, bn, w, st, sp in results[:3]:
            print(f"SWEEP Q={QR:2d} {ms * 1e3:7.1f} us {kv_bytes / ms / 1e6:6.0f} GB/s  block_n={bn} "
                  f"warps={w} stages={st} splits={sp or 'default'}")


def sparse_breakdown(q, k, v, sl, summary) -> None:
    """Graph-replay time of each stage of one sparse step."""
    from kernels.sparse_attention.triton_kernel import block_scores_triton

    S, QR = k.shape[2], q.shape[2]
    scores = block_scores_triton(q, summary.kmin, summary.kmax, sl, 64, 2)
    ids = torch.topk(scores, TOP_K, dim=-1, sorted=False).indices
    stages = {
        "update": lambda: summary.update(k, S - QR, S),
        "score": lambda: block_scores_triton(q, summary.kmin, summary.kmax, sl, 64, 2),
        "topk": lambda: torch.topk(scores, TOP_K, dim=-1, sorted=False).indices,
        "argsort": lambda: torch.argsort(scores, dim=-1, descending=True)[..., :TOP_K],
        "attend": lambda: sparse_attention(q, k, v, sl, ids, block_size=64),
    }
    print("         stages (graph us): " + ", ".join(f"{name} {bench_graph(fn) * 1e3:.1f}" for name, fn in stages.items()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="compare with the references on CUDA first")
    parser.add_argument("--sweep", action="store_true", help="time kernel configurations at 64K")
    parser.add_argument("--sections", default="dense,sparse,scoring",
                        help="comma-separated tables: dense, sparse, scoring; checks: check-dense, "
                             "check-sparse, check-scoring, check-graph")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    if args.check:
        sections |= {"check-dense", "check-sparse", "check-scoring", "check-graph"}
    print(torch.cuda.get_device_name(), f"torch {torch.__version__} triton {triton.__version__}")
    checks = {"check-dense": check_dense, "check-sparse": check_sparse, "check-scoring": check_scoring,
              "check-graph": check_graph}
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
        try:
            sweep()
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
    print("\ndense decode/verify attention, Llama-3-8B heads, bf16, B=1 (times in us)")
    print("kernel: eager call; graph: the same call replayed from a CUDA graph (no launch gaps); "
          "%copy from the graph time")
    print(f"{'ctx':>6} {'q':>2} | {'kernel':>7} {'graph':>7} {'GB/s':>5} {'%copy':>5} | {'sdpa':>7} {'upcast':>7} | "
          f"{'vs sdpa':>7} {'vs upcast':>9}")
    for S in CONTEXTS:
        for QR in Q_ROWS:
            q, k, v = make_inputs(S, QR)
            sl = torch.full((1,), S, device=DEV)
            mask = verify_mask(S, QR)
            t_kernel = bench(lambda: decode_attention(q, k, v, sl))
            t_graph = bench_graph(lambda: decode_attention(q, k, v, sl))
            t_sdpa = bench(lambda: sdpa(q, k, v, mask))
            t_up = bench(lambda: upcast_then_attend(q, k, v, mask))
            bw = 2 * HKV * S * D * 2 / (t_graph * 1e-3)
            print(f"{S // 1024:>5}K {QR:>2} | {t_kernel * 1e3:7.1f} {t_graph * 1e3:7.1f} {bw / 1e9:5.0f} "
                  f"{100 * bw / copy_bw:4.0f}% | "
                  f"{t_sdpa * 1e3:7.1f} {t_up * 1e3:7.1f} | {t_sdpa / t_kernel:6.2f}x {t_up / t_kernel:8.2f}x")
            del q, k, v



def sparse_table() -> None:
    print(f"\nsparse (top_k={TOP_K} blocks of 64, summary update + selection included) vs dense kernel (us)")
    print(f"{'ctx':>6} {'q':>2} | {'dense':>7} {'sparse':>7} {'speedup':>7} | {'dense graph':>11} {'sparse graph':>12} "
          f"{'speedup':>7}")
    for S in SPARSE_CONTEXTS:
        for QR in Q_ROWS:
            q, k, v = make_inputs(S, QR)
            sl = torch.full((1,), S, device=DEV)
            summary = BlockKeySummary.for_cache(k)
            summary.update(k, 0, S)

            def sparse_step():
                summary.update(k, S - QR, S)          # the step's new rows
                return sparse_decode_attention(q, k, v, sl, summary, top_k=TOP_K, min_seq_len=S)

            def dense_step():
                return decode_attention(q, k, v, sl)

            t_d, t_s = bench(dense_step), bench(sparse_step)
            g_d, g_s = bench_graph(dense_step), bench_graph(sparse_step)
            print(f"{S // 1024:>5}K {QR:>2} | {t_d * 1e3:7.1f} {t_s * 1e3:7.1f} {t_d / t_s:6.2f}x | "
                  f"{g_d * 1e3:11.1f} {g_s * 1e3:12.1f} {g_d / g_s:6.2f}x")
            if S == SPARSE_CONTEXTS[-1]:
                sparse_breakdown(q, k, v, sl, summary)
            del q, k, v, summary



def scoring_table(copy_bw: float) -> None:
    print("\nPFlash scoring pass, Qwen3-0.6B drafter heads (16 q, 8 KV, D=128), T=8, bf16, one layer (us)")
    print(f"{'ctx':>6} | {'kernel':>7} {'%copy':>5} | {'reference':>9}")
    for S in SCORING_CONTEXTS:
        qt = torch.randn(16, 8, 128, device=DEV, dtype=torch.bfloat16)
        kk = torch.randn(8, S, 128, device=DEV, dtype=torch.bfloat16)
        t = bench(lambda: score_tail_queries(qt, kk))
        t_ref = bench(lambda: score_tail_queries_reference(qt, kk, 128 ** -0.5))
        bw = 2 * kk.numel() * 2 / (t * 1e-3)                   # two passes over K
        print(f"{S // 1024:>5}K | {t * 1e3:7.1f} {100 * bw / copy_bw:4.0f}% | {t_ref * 1e3:9.1f}")


if __name__ == "__main__":
    main()
