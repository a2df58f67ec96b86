"""small_linear: the Triton kernel against the reference, and row i bitwise independent of M.

On CPU the Triton cases run under TRITON_INTERPRET=1 (conftest) with small shapes and explicit
configs that still reach every path: masked N and K edges, k splits with the reduce kernel,
weight tiles preloaded before the wait, both operand orders, a second block of 16 rows (M = 17..32). On CUDA the same tests run compiled, plus
model-sized shapes with the tuned configs and a CUDA graph capture.
"""
from __future__ import annotations

import pytest
import torch

from batchd.kernels import small_matmul
from batchd.kernels.small_matmul import small_linear, small_linear_reference
from tests.kernels.conftest import DEVICE, REL_ERR, needs_triton, rel_err

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DTYPE_IDS = ["bf16", "f16", "f32"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make(M, N, K, dtype, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype).to(DEVICE)
    b = torch.randn(N, generator=g).to(dtype).to(DEVICE) if bias else None
    return x, w, b


def config(block_n, block_k, splits, swap=True, preload=0, gemv=False):
    from batchd.kernels.small_matmul.triton_kernel import SmallLinearConfig

    return SmallLinearConfig(block_n, block_k, splits, num_warps=4, num_stages=2, swap=swap, preload=preload,
                             gemv=gemv)


GEMV4 = (4, 32, 1, True, 0, True)      # whole weight rows, 4 per program, on the CUDA cores


def run_triton(x, w, b, cfg):
    from batchd.kernels.small_matmul.triton_kernel import small_linear_triton

    small_matmul.check_linear_inputs(x, w, b)
    return small_linear_triton(x, w, b, config=cfg)


def test_reference_matches_per_row_definition():
    x, w, b = make(5, 24, 40, torch.float32, bias=True)
    want = torch.stack([(w.cpu().double() @ x[i].cpu().double()) + b.cpu().double() for i in range(5)])
    got = small_linear_reference(x.cpu(), w.cpu(), b.cpu(), compute_dtype=torch.float64)
    assert rel_err(got, want) < 1e-7                                   # rounded to float32


def test_reference_backend_is_row_invariant():
    x, w, b = make(9, 24, 40, torch.bfloat16, bias=True)
    full = small_linear(x, w, b, backend="reference")
    for i in range(9):
        assert torch.equal(small_linear(x[i:i + 1], w, b, backend="reference")[0], full[i])


# (M, N, K, config or None for the shape's own): masked N/K edges, k splits, both operand orders,
# a second m block, and the maximum M
CASES = [
    pytest.param(1, 64, 128, None, id="m1-n64-k128-default"),
    pytest.param(5, 40, 72, (32, 32, 2, True), id="m5-n40-k72-ragged-split2"),
    pytest.param(17, 72, 96, (64, 32, 3, False), id="m17-n72-k96-split3-noswap"),
    pytest.param(32, 48, 80, (32, 64, 1, True), id="m32-n48-k80-nosplit"),
    pytest.param(17, 42, 72, GEMV4, id="m17-n42-k72-gemv4-ragged"),
]


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("M, N, K, cfg", CASES)
def test_triton_matches_reference(M, N, K, cfg, dtype, bias):
    x, w, b = make(M, N, K, dtype, bias)
    out = run_triton(x, w, b, None if cfg is None else config(*cfg))
    ref = small_linear_reference(x, w, b, compute_dtype=torch.float64)
    assert out.dtype == dtype and out.shape == (M, N)
    assert rel_err(out, ref) < REL_ERR[dtype]


# row i of an M-row call equals the one-row call on x[i], bitwise, for M = 1..17
INVARIANCE = [
    pytest.param(torch.bfloat16, (32, 32, 2, True), True, id="bf16-split2-swap-bias"),
    pytest.param(torch.float16, (64, 64, 1, False), False, id="f16-nosplit-noswap"),
    pytest.param(torch.float32, (32, 32, 3, False), True, id="f32-split3-noswap-bias"),
    pytest.param(torch.bfloat16, GEMV4, True, id="bf16-gemv4-bias"),
    pytest.param(torch.float32, (8, 32, 1, True, 0, True), False, id="f32-gemv8"),
]


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype, cfg, bias", INVARIANCE)
def test_triton_rows_are_batch_invariant(dtype, cfg, bias):
    x, w, b = make(17, 40, 72, dtype, bias, seed=1)
    cfg = config(*cfg)
    alone = torch.cat([run_triton(x[i:i + 1].clone(), w, b, cfg) for i in range(17)])
    ref = small_linear_reference(x, w, b, compute_dtype=torch.float64)
    assert rel_err(alone, ref) < REL_ERR[dtype]
    for M in range(1, 18):
        out = run_triton(x[:M], w, b, cfg)
        assert torch.equal(out, alone[:M]), f"M={M}: rows differ from the one-row calls"
    # a row does not depend on its neighbours either
    shuffled = x[torch.tensor([16, 3, 0, 9])]
    assert torch.equal(run_triton(shuffled, w, b, cfg), alone[[16, 3, 0, 9]])


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("cfg", [(32, 32, 1, True), (32, 16, 3, False), (16, 16, 4, True)],
                         ids=["nosplit-swap", "split3-noswap", "split4-short-last-split"])
def test_preloaded_weight_tiles_change_no_bits(cfg):
    """Tiles requested before the wait enter the sums in the same order: equal bits for every
    preload depth, including depths past the shortest split's k range (capped by the host)."""
    x, w, b = make(5, 40, 72, torch.bfloat16, bias=True, seed=5)
    plain = run_triton(x, w, b, config(*cfg))
    for preload in (1, 2, 4):
        assert torch.equal(run_triton(x, w, b, config(*cfg, preload=preload)), plain), f"preload={preload}"
    assert config(*cfg, preload=4).preload_steps(72) <= 4


@needs_triton
@pytest.mark.triton
def test_public_triton_backend_uses_the_shape_config():
    x, w, b = make(3, 48, 64, torch.bfloat16, bias=True)
    out = small_linear(x, w, b, backend="triton")
    assert rel_err(out, small_linear_reference(x, w, b, compute_dtype=torch.float64)) < REL_ERR[torch.bfloat16]
    assert torch.equal(small_linear(x[1:2], w, b, backend="triton")[0], out[1])


def test_auto_on_cpu_is_the_reference():
    x, w, b = make(3, 16, 24, torch.float32, bias=True)
    x, w, b = x.cpu(), w.cpu(), b.cpu()
    assert torch.equal(small_linear(x, w, b), small_linear_reference(x, w, b))


BAD = [
    pytest.param((4,), (8, 4), None, "expected x", id="x-1d"),
    pytest.param((2, 4), (8, 5), None, "differ in K", id="k-mismatch"),
    pytest.param((33, 4), (8, 4), None, "1..32 rows", id="too-many-rows"),
    pytest.param((0, 4), (8, 4), None, "1..32 rows", id="no-rows"),
    pytest.param((2, 4), (8, 4), (7,), "bias must have shape", id="bias-shape"),
]


@pytest.mark.parametrize("x_shape, w_shape, b_shape, message", BAD)
def test_bad_shapes_raise(x_shape, w_shape, b_shape, message):
    x, w = torch.randn(*x_shape), torch.randn(*w_shape)
    b = None if b_shape is None else torch.randn(*b_shape)
    with pytest.raises(ValueError, match=message):
        small_linear(x, w, b)


def test_bad_dtypes_layouts_and_backend_raise():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="share one dtype"):
        small_linear(x, w.half())
    with pytest.raises(ValueError, match="share one dtype"):
        small_linear(x.double(), w.double())
    with pytest.raises(ValueError, match="bias must have x's dtype"):
        small_linear(x, w, torch.randn(4).half())
    with pytest.raises(ValueError, match="contiguous"):
        small_linear(torch.randn(8, 2).t(), w)
    with pytest.raises(ValueError, match="contiguous"):
        small_linear(x, torch.randn(8, 4).t())
    with pytest.raises(ValueError, match="backend must be one of"):
        small_linear(x, w, backend="cublas")


# ----------------------------------------------------------------------------------- CUDA only

MODEL_SHAPES = [  # (N, K): Qwen2.5-1.5B o/qkv/down and a Llama-3-8B o projection
    pytest.param(1536, 1536, id="qwen-o"),
    pytest.param(2048, 1536, id="qwen-qkv"),
    pytest.param(1536, 8960, id="qwen-down"),
    pytest.param(4096, 4096, id="llama-o"),
    pytest.param(1000, 1000, id="ragged-1000"),
]


@needs_cuda
@needs_triton
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("N, K", MODEL_SHAPES)
def test_cuda_model_shapes_are_invariant(N, K, bias):
    x, w, b = make(32, N, K, torch.bfloat16, bias, seed=2)
    alone = torch.cat([small_linear(x[i:i + 1].clone(), w, b) for i in range(32)])
    assert rel_err(alone, small_linear_reference(x, w, b, compute_dtype=torch.float64)) < REL_ERR[torch.bfloat16]
    for M in range(1, 33):
        assert torch.equal(small_linear(x[:M], w, b), alone[:M]), f"M={M}"


@needs_cuda
@needs_triton
def test_cuda_graph_capture_replays_the_same_bits():
    x, w, b = make(5, 2048, 1536, torch.bfloat16, bias=True, seed=3)
    eager = small_linear(x, w, b)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        small_linear(x, w, b)                                   # warm up (compile) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = small_linear(x, w, b)
    x.copy_(make(5, 2048, 1536, torch.bfloat16, seed=4)[0])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, small_linear(x, w, b))
    assert not torch.equal(captured, eager)


# ---- decode-step fusions: folded RMSNorm (x = norm_weight * h, rows scaled after the sum), silu*mul of
# a stacked gate/up weight, residual epilogue, and the NormInputs a residual projection emits ----

def fusion_inputs(M, N, K, dtype, gated=False, parts=1, seed=2):
    g = torch.Generator().manual_seed(seed)
    x, w, b = make(M, 2 * N if gated else N, K, dtype, bias=not gated, seed=seed)
    h = (torch.randn(M, K, generator=g) * 2).to(dtype).to(DEVICE)
    nw = (1 + 0.1 * torch.randn(K, generator=g)).to(dtype).to(DEVICE)
    weighted, sumsq = small_matmul.norm_inputs(h, nw, backend="reference")
    sumsq = (sumsq / parts).expand(parts, M).contiguous()             # the same total in `parts` parts
    res = torch.randn(M, N, generator=g).to(dtype).to(DEVICE)
    next_nw = (1 + 0.1 * torch.randn(N, generator=g)).to(dtype).to(DEVICE)
    return dict(x=x, w=w, b=b, h=h, nw=nw, weighted=weighted, sumsq=sumsq, res=res, next_nw=next_nw)


def triton_fused(cfg, x, w, b=None, **kw):
    from batchd.kernels.small_matmul.triton_kernel import small_linear_triton

    return small_linear_triton(x, w, b, config=config(*cfg), **kw)


FUSED = [  # (kind, cfg)
    pytest.param("norm", (32, 32, 1, True), id="norm-bias"),
    pytest.param("norm", (32, 32, 2, False), id="norm-bias-split2-noswap"),
    pytest.param("norm-gated", (32, 32, 1, True), id="norm-gated"),
    pytest.param("norm-gated", (64, 64, 1, False), id="norm-gated-noswap"),
    pytest.param("residual-emit", (16, 32, 1, True), id="residual-emit"),
    pytest.param("residual-emit", (32, 32, 3, False), id="residual-emit-split3-noswap"),
    pytest.param("norm", GEMV4, id="norm-bias-gemv4"),
    pytest.param("residual-emit", GEMV4, id="residual-emit-gemv4"),
]


def run_fused(kind, cfg, t, rows=slice(None), backend="triton"):
    x, sumsq = t["weighted"][rows], t["sumsq"][:, rows].contiguous()
    if kind == "norm":
        kw = dict(row_sumsq=sumsq, eps=1e-5)
        args = (x, t["w"], t["b"])
    elif kind == "norm-gated":
        kw = dict(row_sumsq=sumsq, eps=1e-5, gated=True)
        args = (x, t["w"], None)
    else:
        kw = dict(residual=t["res"][rows], emit_norm_weight=t["next_nw"])
        args = (t["x"][rows], t["w"], t["b"])
    if backend == "reference":
        return small_linear_reference(*args, compute_dtype=torch.float64, **kw)
    return triton_fused(cfg, *args, **kw)


def flat(result):
    """out, or (out, NormInputs) -> out, weighted, summed sumsq (parts differ by backend)"""
    if isinstance(result, tuple):
        out, (weighted, sumsq) = result
        return out, weighted, sumsq.sum(0)
    return (result,)


def by_rows(result):
    """out, or (out, NormInputs) -> out, weighted and the sums of squares' parts as [M, P], compared
    as they are (summing the parts in torch may take another order for another M)"""
    if isinstance(result, tuple):
        out, (weighted, sumsq) = result
        return out, weighted, sumsq.t()
    return (result,)


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("kind, cfg", FUSED)
def test_fused_matches_reference(kind, cfg, dtype):
    t = fusion_inputs(5, 40, 72, dtype, gated=kind == "norm-gated", parts=3)
    for got, want in zip(flat(run_fused(kind, cfg, t)), flat(run_fused(kind, cfg, t, backend="reference"))):
        assert got.shape == want.shape
        assert rel_err(got, want) < 2 * REL_ERR[dtype]


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("kind, cfg", FUSED[1:3] + FUSED[5:])
def test_fused_rows_are_batch_invariant(kind, cfg):
    t = fusion_inputs(17, 40, 72, torch.bfloat16, gated=kind == "norm-gated", seed=3)
    alone = [by_rows(run_fused(kind, cfg, t, slice(i, i + 1))) for i in range(17)]
    alone = [torch.cat(parts) for parts in zip(*alone)]
    for M in (2, 5, 16, 17):
        for got, want in zip(by_rows(run_fused(kind, cfg, t, slice(0, M))), alone):
            assert torch.equal(got, want[:M]), f"M={M}: fused rows differ from one-row calls"


def test_folded_norm_is_rms_norm_then_linear():
    """The fusion's definition against the unfused ops: rms_norm(h) then the projection."""
    from batchd.kernels.rms_norm import rms_norm_reference

    t = fusion_inputs(4, 24, 40, torch.float32)
    normed = rms_norm_reference(t["h"], t["nw"], 1e-5)[0]
    want = small_linear_reference(normed, t["w"], t["b"])
    got = small_linear(t["weighted"], t["w"], t["b"], row_sumsq=t["sumsq"], eps=1e-5)
    assert rel_err(got, want) < 1e-6
    out, nxt = small_linear(t["x"], t["w"], t["b"], residual=t["res"], emit_norm_weight=t["next_nw"])
    assert torch.equal(out, small_linear(t["x"], t["w"], t["b"]) + t["res"])
    assert torch.equal(nxt.weighted, out * t["next_nw"])
    assert torch.allclose(nxt.sumsq.sum(0), out.pow(2).sum(-1))   # in parts (the kernel's column tiles)


@needs_triton
@pytest.mark.triton
def test_norm_inputs_kernel_matches_reference():
    from batchd.kernels.small_matmul.triton_kernel import norm_inputs_triton

    t = fusion_inputs(3, 8, 72, torch.bfloat16)
    got, want = norm_inputs_triton(t["h"], t["nw"]), small_matmul.norm_inputs(t["h"], t["nw"], backend="reference")
    assert rel_err(got.weighted, want.weighted) < REL_ERR[torch.bfloat16]   # the interpreter rounds bf16 its own way
    assert rel_err(got.sumsq, want.sumsq) < 1e-6
    assert torch.equal(norm_inputs_triton(t["h"][1:2], t["nw"]).sumsq[0, 0], got.sumsq[0, 1])


def test_fusion_inputs_are_checked():
    x, w = torch.randn(2, 8), torch.randn(5, 8)
    with pytest.raises(ValueError, match="gate and up rows"):
        small_linear(x, w, gated=True)
    with pytest.raises(ValueError, match="row_sumsq must be"):
        small_linear(x, w, row_sumsq=torch.ones(1, 3))
    with pytest.raises(ValueError, match="residual must be"):
        small_linear(x, w, residual=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="no bias"):
        small_linear(x, torch.randn(6, 8), torch.randn(3), gated=True)
    with pytest.raises(ValueError, match="needs residual"):
        small_linear(x, w, emit_norm_weight=torch.ones(5))


# ---- rope and the cache write in the q/k/v projection's epilogue ----

QKV_ROPE = [  # (block_n, splits, bias, T, gemv): tiles of 8 and 4 rope pairs, one and three rows
    pytest.param(16, 1, True, 3, False, id="pairs8-bias-t3"),
    pytest.param(8, 1, False, 1, False, id="pairs4-t1"),
    pytest.param(16, 1, False, 17, False, id="pairs8-t17"),
    pytest.param(4, 1, True, 3, True, id="gemv-pairs2-bias-t3"),
]


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("block_n, splits, bias, T, gemv", QKV_ROPE)
def test_qkv_rope_epilogue_equals_projection_then_rope_kernel(block_n, splits, bias, T, gemv, dtype):
    """One launch (projection + rope + cache write) against the two it replaces, bitwise: q and
    both caches, with the input RMSNorm folded in as in a decode step."""
    from batchd.kernels.rope_cache import rope_and_store
    from batchd.kernels.small_matmul.triton_kernel import RopeTarget, rope_fits, small_linear_triton

    Hq, Hkv, D, K, S, start = 4, 2, 16, 48, 40, 5
    N = (Hq + 2 * Hkv) * D
    t = fusion_inputs(T, N, K, dtype, seed=7)
    x, w, b, sumsq = t["weighted"], t["w"], t["b"] if bias else None, t["sumsq"]
    g = torch.Generator().manual_seed(8)
    angles = torch.randn(T, D // 2, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(DEVICE), torch.cat([angles.sin()] * 2, -1).to(DEVICE)
    positions = torch.arange(start, start + T, device=DEVICE)
    cfg = config(block_n, 16, splits, gemv=gemv)
    assert rope_fits(cfg, N, K, D)
    caches = [torch.randn(1, Hkv, S, D, generator=g).to(dtype).to(DEVICE) for _ in range(2)]
    fused_k, fused_v = caches[0].clone(), caches[1].clone()
    q = small_linear_triton(x, w, b, row_sumsq=sumsq, eps=1e-5, config=cfg,
                            rope=RopeTarget(cos, sin, positions, fused_k, fused_v, Hq, Hkv))
    qkv = small_linear_triton(x, w, b, row_sumsq=sumsq, eps=1e-5, config=cfg)
    want_q = rope_and_store(qkv.view(1, T, N), cos, sin, positions, caches[0], caches[1], Hq, Hkv, backend="triton")
    assert q.shape == (1, Hq, T, D)
    assert torch.equal(q, want_q)
    assert torch.equal(fused_k, caches[0]) and torch.equal(fused_v, caches[1])


def test_rope_fits_needs_whole_pairs_of_one_head_and_no_split():
    from batchd.kernels.small_matmul.triton_kernel import rope_fits

    assert rope_fits(config(64, 128, 1), 6144, 4096, 128)
    assert not rope_fits(config(256, 128, 1), 6144, 4096, 128)       # a tile would span two heads
    assert not rope_fits(config(64, 128, 3), 6144, 4096, 128)        # a k split
    assert not rope_fits(config(32, 16, 1), 128, 48, 16)             # 16 pairs per tile, 8 per head half


# ---- settled inputs read before the wait (EARLY, kernels._pdl) ----

@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("kind, cfg", [FUSED[0], FUSED[2], FUSED[4], FUSED[5], FUSED[7]])
def test_settled_inputs_read_early_change_no_bits(kind, cfg, use_options):
    """settled=True moves the epilogue's reads (bias, residual, next norm weight; the reduce
    kernel's with a k split) before the wait: the same outputs, bit for bit, as reading them after
    the k loop (early_reads="off") and as settled=False."""
    t = fusion_inputs(5, 40, 72, torch.bfloat16, gated=kind == "norm-gated", parts=3)
    x, sumsq = t["weighted"], t["sumsq"]
    if kind == "norm":
        args, kw = (x, t["w"], t["b"]), dict(row_sumsq=sumsq, eps=1e-5)
    elif kind == "norm-gated":
        args, kw = (x, t["w"], None), dict(row_sumsq=sumsq, eps=1e-5, gated=True)
    else:
        args, kw = (t["x"], t["w"], t["b"]), dict(residual=t["res"], emit_norm_weight=t["next_nw"])
    early = flat(triton_fused(cfg, *args, settled=True, **kw))
    use_options(early_reads="off")
    late = flat(triton_fused(cfg, *args, settled=True, **kw))
    use_options(early_reads="auto")
    unsettled = flat(triton_fused(cfg, *args, **kw))
    for a, b, c in zip(early, late, unsettled):
        assert torch.equal(a, b) and torch.equal(a, c)


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("T", [1, 3])
def test_settled_rope_rows_read_early_change_no_bits(T, use_options):
    """The q/k/v projection's epilogue with its rope rows and positions read before the wait."""
    from batchd.kernels.small_matmul.triton_kernel import RopeTarget, small_linear_triton

    Hq, Hkv, D, K, S, start = 4, 2, 16, 48, 40, 5
    N = (Hq + 2 * Hkv) * D
    t = fusion_inputs(T, N, K, torch.bfloat16, seed=7)
    g = torch.Generator().manual_seed(8)
    angles = torch.randn(T, D // 2, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(DEVICE), torch.cat([angles.sin()] * 2, -1).to(DEVICE)
    positions = torch.arange(start, start + T, device=DEVICE)
    caches = [torch.randn(1, Hkv, S, D, generator=g).to(torch.bfloat16).to(DEVICE) for _ in range(2)]

    def run(settled):
        k, v = caches[0].clone(), caches[1].clone()
        q = small_linear_triton(t["weighted"], t["w"], t["b"], row_sumsq=t["sumsq"], eps=1e-5, config=config(16, 16, 1),
                                rope=RopeTarget(cos, sin, positions, k, v, Hq, Hkv), settled=settled)
        return q, k, v

    early = run(True)
    use_options(early_reads="off")
    for a, b in zip(early, run(True)):
        assert torch.equal(a, b)
    use_options(early_reads="auto")
    for a, b in zip(early, run(False)):
        assert torch.equal(a, b)


@needs_cuda
@needs_triton
@pytest.mark.parametrize("kind", ["qkv-rope", "o", "gate_up", "down"])
def test_cuda_settled_reads_change_no_bits_at_qwen_shapes(kind, use_options):
    """The compiled kernels at Qwen2.5-1.5B's shapes and tuned configs, each call finished before the
    next (no overlap, so no ordering question): settled reads before the wait give the bits of
    reads after the k loop, on 8 inputs each. (Reading the o projection's residual early moved its
    emitted sums of squares in 16 of 20 inputs: the compiler chose another epilogue layout.)"""
    from batchd.kernels.small_matmul import qkv_rope_and_store

    Hq, Hkv, D, H, I = 12, 2, 128, 1536, 8960
    g = torch.Generator().manual_seed(11)
    rnd = lambda *shape, s=1.0: (torch.randn(*shape, generator=g) * s).to(torch.bfloat16).cuda()  # noqa: E731
    N, K = {"qkv-rope": ((Hq + 2 * Hkv) * D, H), "gate_up": (2 * I, H), "o": (H, H), "down": (H, I)}[kind]
    w, b, nw = rnd(N, K, s=K**-0.5), rnd(N), rnd(N)
    angles = torch.randn(1, D // 2, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1).cuda(), torch.cat([angles.sin()] * 2, -1).cuda()
    caches = [rnd(1, Hkv, 64, D) for _ in range(2)]

    def call(x, res, sumsq):
        if kind == "qkv-rope":
            k, v = caches[0].clone(), caches[1].clone()
            q = qkv_rope_and_store(x, w, b, cos=cos, sin=sin, positions=torch.tensor([40], device="cuda"), k_cache=k,
                                   v_cache=v, num_heads=Hq, num_kv_heads=Hkv, row_sumsq=sumsq, eps=1e-6, settled=True)
            result = (q, k, v)
        elif kind == "gate_up":
            result = (small_linear(x, w, row_sumsq=sumsq, eps=1e-6, gated=True, settled=True),)
        else:
            result = flat(small_linear(x, w, residual=res, emit_norm_weight=nw, settled=True))
        torch.cuda.synchronize()
        return result

    for _ in range(8):
        inputs = rnd(1, K), rnd(1, N), (torch.rand(2, 1, generator=g) * 500 + 100).cuda()
        use_options(early_reads="auto")
        early = call(*inputs)
        use_options(early_reads="off")
        for a, b_ in zip(early, call(*inputs)):
            assert torch.equal(a, b_)


def test_gemv_configs_refuse_what_they_cannot_hold():
    """A gemv program keeps whole weight rows in registers and has no k loop: no gate/up pairs, no
    k split, K at most 2048; and it never preloads (its rows are all read before the wait)."""
    from batchd.kernels.small_matmul.triton_kernel import small_linear_triton

    x = torch.zeros(1, 4096)
    with pytest.raises(ValueError, match="K <= 2048"):
        small_linear_triton(x, torch.zeros(8, 4096), None, config=config(*GEMV4))
    with pytest.raises(ValueError, match="no gemv"):
        small_linear_triton(x[:, :64], torch.zeros(16, 64), None, gated=True, config=config(*GEMV4))
    assert config(*GEMV4[:4], preload=3, gemv=True).preload_steps(72) == 0
    assert config(4, 32, 3, gemv=True).effective_splits(4096) == 1


def test_split_k_steps_counts_full_and_last_splits():
    assert config(32, 32, 2).split_k_steps(128) == (2, 2) and config(16, 32, 3).split_k_steps(224) == (3, 1)


def compile_decode_kernels_for_hopper() -> dict:
    """Compile (not run) small_linear as Qwen2.5-1.5B's decode layer launches it, for sm_90, with
    bench/kernel_resources.py: the table's configs and the traced kernel (paths
    the CPU interpreter never compiles). Needs TRITON_INTERPRET unset, no GPU. -> {case: resources}"""
    import torch
    from bench import kernel_resources as kr
    from batchd.kernels.small_matmul import triton_kernel as tk

    table = lambda n, k, gated=False: tk.choose_config(n, k, torch.bfloat16, torch.device("cuda"), gated=gated)  # noqa: E731
    # qkv's and gate_up's entries stream through kernels.stream_linear (CUDA); without an sm_90 GPU
    # choose_config falls back to Triton tiles for the multiprocessors it is told of (the H200's 132)
    tk.multiprocessor_count = lambda device: 132
    qkv = dict(rope=True, norm=True, bias=True)
    cases = {
        "qkv": (table(2048, 1536), 2048, 1536, qkv, {}),
        "o": (table(1536, 1536), 1536, 1536, dict(residual=True), {}),
        "gate_up": (table(8960, 1536, gated=True), 8960, 1536, dict(gated=True, norm=True, parts_in=192), {}),
        "down": (table(1536, 8960), 1536, 8960, dict(residual=True), {}),
        "qkv, traced": (table(2048, 1536), 2048, 1536, qkv, dict(TRACE=True)),
    }
    return {name: kr.resources(cfg, {**kr.constexprs(cfg, N, K, **fusion), **extra})
            for name, (cfg, N, K, fusion, extra) in cases.items()}


def test_decode_kernels_compile_for_hopper_without_spills():
    """The H200's compiler sees what the interpreter does not (types, registers): every table config
    of the 1.5B decode layer and the traced kernel compile for sm_90, and none
    of them spills registers to local memory (a spill there costs every decode step)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import json; from tests.kernels.test_small_matmul import compile_decode_kernels_for_hopper as c; "
            "print(json.dumps(c()))")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                          env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    resources = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(resources) == 5
    for name, used in resources.items():
        assert used["spill_stack_bytes"] == 0, f"{name} spills: {used}"


def test_bench_specs_name_the_configs_they_mean():
    """bench/step_sweep.py and bench/ncu_linear.py read configs through bench.common.linear_config:
    positional tile fields, then named SmallLinearConfig fields, or a gemv."""
    from bench.common import linear_config
    from batchd.kernels.small_matmul.triton_kernel import SmallLinearConfig as C

    assert linear_config("16,128,1,4") == C(16, 128, 1, num_warps=4, num_stages=4, swap=True)
    assert linear_config("64,128,8,3,2") == C(64, 128, 8, num_warps=4, num_stages=3, swap=True, preload=2)
    assert linear_config("16,128,1,4,num_warps:8") == C(16, 128, 1, num_warps=8, num_stages=4, swap=True)
    assert linear_config("gemv,8") == C(8, 128, 1, num_warps=4, gemv=True)
    assert linear_config("gemv,8,8") == C(8, 128, 1, num_warps=8, gemv=True)
    assert linear_config("gemv,8,trigger:2") == C(8, 128, 1, num_warps=4, gemv=True, trigger=2)
    assert linear_config("16,128,1,4,trigger:2") == C(16, 128, 1, num_warps=4, num_stages=4, swap=True, trigger=2)
    with pytest.raises(TypeError):
        linear_config("16,128,1,4,no_such_field:1")


def test_step_sweep_runs_variants_interleaved_after_a_warmup():
    """bench/step_sweep.py: one untimed run of the first variant (a process's first run reads fast),
    then the list `rounds` times over, interleaved; the medians table groups the timed runs."""
    from bench.step_sweep import medians, run_order

    assert run_order(["table", "x"], 2, 1) == [("table", False), ("table", True), ("x", True), ("table", True),
                                               ("x", True)]
    assert run_order(["table"], 1, 0) == [("table", True)]
    rows = [dict(shape="s", variant=v, **{"decode tok/s": t}) for v, t in (("a", 3), ("b", 1), ("a", 5), ("a", 4))]
    assert medians(rows) == [dict(shape="s", variant="a", runs=3, **{"median tok/s": 4, "min": 3, "max": 5}),
                             dict(shape="s", variant="b", runs=1, **{"median tok/s": 1, "min": 1, "max": 1})]


def test_step_sweep_skip_drops_the_launch_until_the_next_variant():
    """bench/step_sweep.py skip=merge / skip=reduce / skip=o: the attention merge returns its output
    buffer untouched, the split-K reduce launches nothing, an o projection returns its residual;
    attn_splits=N caps the attention's splits at N instead of 132; merge_cols=N sets the merge's
    columns a program; the next variant puts them all back."""
    from bench import step_sweep
    from batchd.kernels.decode_attention import triton_kernel as attention_kernel
    from batchd.kernels.small_matmul import triton_kernel

    tuned = dict(triton_kernel.TUNED)
    try:
        step_sweep.apply_variant("skip=merge skip=reduce attn_splits=200 merge_cols=64", tuned)
        assert attention_kernel.MAX_SPLITS == 200 and attention_kernel.MERGE_COLUMNS == 64
        out = torch.full((2,), 7.0)
        assert attention_kernel.merge_splits(None, None, out, None, block_n=32, splits_from_seq_len=True) is out
        assert triton_kernel._reduce_splits_kernel[(1, 1)](out, SPLITS=2) is None
        with pytest.raises(SystemExit, match="merge, reduce or o"):
            step_sweep.apply_variant("skip=split", tuned)
        step_sweep.apply_variant("skip=o", tuned)
        residual = torch.randn(1, 8)
        out, inputs = triton_kernel.small_linear_triton(torch.randn(1, 8), torch.randn(8, 8), residual=residual,
                                                        emit_norm_weight=torch.ones(8))
        assert out is residual and inputs.sumsq.shape == (1, 1)   # o: nothing launched, the residual back
        assert step_sweep.MERGE_SPLITS is attention_kernel.merge_splits   # skip=o alone leaves the merge
    finally:
        step_sweep.apply_variant("table", tuned)
    assert triton_kernel.small_linear_triton is step_sweep.SMALL_LINEAR
    assert attention_kernel.merge_splits is step_sweep.MERGE_SPLITS
    assert triton_kernel._reduce_splits_kernel is step_sweep.REDUCE_KERNEL
    assert attention_kernel.MAX_SPLITS == step_sweep.MAX_SPLITS == 132
    assert attention_kernel.MERGE_COLUMNS == step_sweep.MERGE_COLUMNS == 32


def test_step_sweep_options_hold_for_their_variant_only():
    """bench/step_sweep.py passes kernel what-ifs through kernels.options (never the environment):
    OPTION=VALUE (or the old BATCHD_OPTION=VALUE spelling) and mlp= set them for that variant's
    engine; the next variant starts from the environment's defaults again."""
    from bench import step_sweep
    from batchd.kernels.options import KernelOptions, current_options, environment_defaults
    from batchd.kernels.small_matmul import triton_kernel

    tuned = dict(triton_kernel.TUNED)
    try:
        step_sweep.apply_variant("pdl_trigger=linear:2 BATCHD_EARLY_READS=0 attention_cluster=8 "
                                 "stream_phase_marks=1", tuned)
        assert current_options() == KernelOptions(pdl_trigger={"linear": 2}, early_reads="off", attention_cluster=8,
                                                  stream_phase_marks=1)
        step_sweep.apply_variant("mlp=4864,896,0,64,64,4,5", tuned)
        assert current_options().fused_mlp is True and current_options().early_reads == "auto"
        with pytest.raises(SystemExit, match="unknown option"):
            step_sweep.apply_variant("BATCHD_NO_SUCH=1", tuned)
    finally:
        step_sweep.apply_variant("table", tuned)
    assert current_options() == environment_defaults()


def test_a_config_trigger_overrides_the_linear_knob_for_that_weight_only(use_options):
    """SmallLinearConfig.trigger sets one weight's PDL trigger point (kernels._pdl); None keeps the
    "linear" knob's; 0 (launches two deep) only where the next launch reads nothing early that the
    one before writes, which the table's entries promise, not the config."""
    from batchd.kernels.small_matmul.triton_kernel import SmallLinearConfig as C
    from batchd.kernels.small_matmul.triton_kernel import linear_constexprs

    def trigger(config):
        return linear_constexprs(config, 1536, 1536, torch.bfloat16, bias=False, norm_parts=0, gated=False,
                                 residual=False, emit=False, pdl=True, early=True, rope_heads=None)["TRIGGER"]

    use_options(pdl_trigger=1)
    assert trigger(C(8, 128, 1, gemv=True)) == 1
    assert trigger(C(8, 128, 1, gemv=True, trigger=2)) == 2
    use_options(pdl_trigger={"linear": 2})
    assert trigger(C(8, 128, 1, gemv=True)) == 2
    assert trigger(C(8, 128, 1, gemv=True, trigger=1)) == 1
    assert trigger(C(8, 128, 1, gemv=True, trigger=0)) == 0     # the caller's promise (__post_init__)
    with pytest.raises(ValueError, match="0, 1 or 2"):
        trigger(C(8, 128, 1, gemv=True, trigger=3))


@needs_triton
def test_a_config_reduce_trigger_reaches_the_reduce_launch(monkeypatch, use_options):
    """SmallLinearConfig.reduce_trigger sets the k split's reduce's trigger point (0 before its wait:
    kernels._pdl); None keeps the "reduce" knob's. The point moves no value."""
    from batchd.kernels.small_matmul import triton_kernel as tk

    real, seen = tk._reduce_splits_kernel, []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs["TRIGGER"])
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(tk, "_reduce_splits_kernel", Recorder())
    use_options(pdl_trigger=1)
    x, w, b = make(3, 48, 256, torch.float32, bias=True, seed=5)
    early = tk.small_linear_triton(x, w, b, config=tk.SmallLinearConfig(16, 32, 2, reduce_trigger=0))
    knob = tk.small_linear_triton(x, w, b, config=tk.SmallLinearConfig(16, 32, 2))
    assert seen == [0, 1]
    assert torch.equal(early, knob)
    assert rel_err(early, small_linear_reference(x, w, b, compute_dtype=torch.float64)) < REL_ERR[torch.float32]


def test_a_stream_table_entry_falls_back_to_triton_tiles_where_the_kernel_cannot_run(monkeypatch):
    """Qwen2.5-1.5B's gate_up streams through kernels.stream_linear, a CUDA kernel for
    sm_90+ in bf16/f16; on another GPU the same weight takes the heuristic's Triton tiles, whole
    (no k split: silu needs the whole sum)."""
    from batchd.kernels.small_matmul import triton_kernel

    assert triton_kernel.TUNED[(17920, 1536, 2)].stream
    monkeypatch.setattr(triton_kernel, "multiprocessor_count", lambda device: 108)   # an A100
    monkeypatch.setattr(triton_kernel, "stream_runs", lambda device, dtype: False)
    config = triton_kernel.choose_config(8960, 1536, torch.bfloat16, torch.device("cuda"), gated=True)
    assert not config.stream and config.splits == 1
    assert triton_kernel.TUNED[(2048, 1536, 2)].stream                                # qkv
    assert triton_kernel.TUNED[(2048, 1536, 2)].stream_max_ctas == 128                # one CTA an SM, 4 SMs left
    assert not triton_kernel.choose_config(2048, 1536, torch.bfloat16, torch.device("cuda")).stream


def test_an_early_reduce_trigger_is_kept_only_where_a_stream_kernel_can_follow(monkeypatch):
    """Qwen2.5-1.5B's down signals from its reduce before the reduce waits, so that the
    stream qkv after it fills its weight ring while down runs; before a Triton qkv that lost, so where
    stream kernels cannot run the reduce takes the "reduce" knob's point again."""
    from batchd.kernels.small_matmul import triton_kernel

    assert triton_kernel.TUNED[(1536, 8960, 2)].reduce_trigger == 0
    assert triton_kernel.choose_config(1536, 8960, torch.bfloat16, torch.device("cuda")).reduce_trigger == 0 \
        or not triton_kernel.stream_runs(torch.device("cuda"), torch.bfloat16)
    monkeypatch.setattr(triton_kernel, "stream_runs", lambda device, dtype: False)
    config = triton_kernel.choose_config(1536, 8960, torch.bfloat16, torch.device("cuda"))
    assert config.reduce_trigger is None and config.splits == 10


@pytest.mark.parametrize("field, value", [("reduce_trigger", 3), ("reduce_trigger", -1), ("trigger", -1)])
def test_configs_refuse_trigger_points_other_than_0_1_2(field, value):
    from batchd.kernels.small_matmul.triton_kernel import SmallLinearConfig

    with pytest.raises(ValueError, match="trigger point"):
        SmallLinearConfig(16, 128, 1, **{field: value})
    # any config may signal at its start (the table entry's promise): a stream kernel's next launch
    # then fills its own ring meanwhile
    assert SmallLinearConfig(16, 128, 1, stream=True, trigger=0).trigger == 0
