"""A bare CUDA-core GEMV (many programs, a few whole weight rows each) against small_linear's tuned
tl.dot tiles, both in a dependent chain (each call's x is the previous call's output, PDL, one CUDA
graph, a new weight copy per call so every call streams from HBM): how fast can a small projection
(Qwen2.5-1.5B's o, 4.7 MB) stream at batch 1, and how many programs and rows per program does it take?

    python bench/gemv_chain.py

H200, stop 13: the tiles' table config 4.9 us per call, the GEMV 2.5-2.6 us at 4 rows per program
(384 programs) with 4 warps; small_linear's gemv config is this kernel with the fused epilogues
(kernels/small_matmul/NOTES.md, "Stop 13"; in whole decode steps the gain is smaller).
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch, triton, triton.language as tl
from bench.common import graph_replay_time, print_table
from batchd.kernels._backend import launch_options
from batchd.kernels.small_matmul.triton_kernel import SmallLinearConfig, small_linear_triton

@triton.jit
def _gemv(X, W, Out, M, K: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr, PRE: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BK)
    wp = W + rows[:, None].to(tl.int64) * K + offs[None, :]
    if PRE:
        w0 = tl.load(wp, eviction_policy="evict_first")
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    for m in range(M):
        acc = tl.zeros([ROWS, BK], dtype=tl.float32)
        for c in tl.static_range(K // BK):
            if PRE and c == 0:
                w = w0
            else:
                w = tl.load(wp + c * BK, eviction_policy="evict_first")
            x = tl.load(X + m * K + c * BK + offs)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        tl.store(Out + m * K + rows, tl.sum(acc, 1).to(Out.dtype.element_ty))

R = 48
N = K = 1536
ws = [(torch.randn(N, K, device="cuda") / K ** 0.5).to(torch.bfloat16) for _ in range(R)]
rows = []
x0 = torch.randn(1, N, device="cuda").to(torch.bfloat16)
outs = [torch.empty(1, N, device="cuda", dtype=torch.bfloat16) for _ in range(R)]
for r, bk, nw, pre in ((4, 512, 4, 0), (4, 256, 4, 0), (2, 512, 4, 0), (8, 256, 4, 0), (8, 512, 8, 0), (4, 512, 2, 0),
                       (4, 512, 4, 1), (2, 512, 2, 0), (2, 256, 2, 0), (1, 512, 2, 0)):
    if K % bk:
        continue
    def chain():
        x = x0
        for i in range(R):
            _gemv[(N // r,)](x, ws[i], outs[i], 1, K=K, ROWS=r, BK=bk, PRE=pre, num_warps=nw, **launch_options(True))
            x = outs[i]
    t = graph_replay_time(chain) / R
    ref = (x0.float() @ ws[0].float().T)
    _gemv[(N // r,)](x0, ws[0], outs[0], 1, K=K, ROWS=r, BK=bk, PRE=pre, num_warps=nw)
    err = ((outs[0].float() - ref).abs().max() / ref.abs().max()).item()
    rows.append(dict(kind=f"gemv rows{r} bk{bk} w{nw} pre{pre}", programs=N // r, us=round(t * 1e6, 2), err=f"{err:.1e}"))
    print(rows[-1], flush=True)
for kind, cfg, programs in (("small_linear tiles 16x128 s4 (o before stop 13)", SmallLinearConfig(16, 128, 1, num_stages=4), 96),
                            ("small_linear gemv 8 rows (o's table entry)", SmallLinearConfig(8, 128, 1, gemv=True), 192)):
    def chain2(cfg=cfg):
        x = x0
        for i in range(R):
            x = small_linear_triton(x, ws[i], None, config=cfg)
    rows.append(dict(kind=kind, programs=programs, us=round(graph_replay_time(chain2) / R * 1e6, 2), err=""))
print_table(rows)
