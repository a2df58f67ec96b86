"""row_linear: the Triton kernel against the reference, and a row's bits independent of M and of its neighbours.

On CPU the Triton cases run under TRITON_INTERPRET=1 (conftest) with small shapes and small explicit
configs that still reach every path: ragged N and K edges, several m tiles, a short last group of
the grouped order, bias or none. On CUDA the same tests run compiled, plus Llama-3-8B-like shapes
with the table's configs at M = 1..512.
"""
from __future__ import annotations

import pytest
import torch

from batchd.kernels.row_gemm import check_row_linear_inputs, row_linear, row_linear_reference
from tests.kernels.conftest import DEVICE, REL_ERR, needs_triton, rel_err

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DTYPE_IDS = ["bf16", "f16", "f32"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make(M, N, K, dtype, bias=False, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype).to(device)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype).to(device)
    b = torch.randn(N, generator=g).to(dtype).to(device) if bias else None
    return x, w, b


def config(block_m=16, block_n=32, block_k=32, group_m=4):
    from batchd.kernels.row_gemm.triton_kernel import RowGemmConfig

    return RowGemmConfig(block_m, block_n, block_k, group_m=group_m, num_warps=4, num_stages=2)


def run_triton(x, w, b, cfg):
    from batchd.kernels.row_gemm.triton_kernel import row_linear_triton

    check_row_linear_inputs(x, w, b)
    return row_linear_triton(x, w, b, config=cfg)


def test_reference_is_the_float32_product_rounded_once():
    x, w, b = make(5, 24, 40, torch.bfloat16, bias=True)
    x, w, b = x.cpu(), w.cpu(), b.cpu()
    want = (x.float() @ w.float().T + b.float()).to(torch.bfloat16)
    assert torch.equal(row_linear_reference(x, w, b), want)
    assert torch.equal(row_linear(x, w, b), want)                      # auto on CPU: the reference


# (M, N, K, config): one row; ragged N and K; several m tiles with a short last group; exact tiles
CASES = [
    pytest.param(1, 64, 128, config(), id="m1-n64-k128"),
    pytest.param(7, 40, 72, config(), id="m7-n40-k72-ragged"),
    pytest.param(130, 40, 72, config(), id="m130-n40-k72-9-mtiles-group4"),
    pytest.param(64, 96, 64, config(32, 32, 16, group_m=1), id="m64-n96-k64-ungrouped"),
]


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("M, N, K, cfg", CASES)
def test_triton_matches_reference(M, N, K, cfg, dtype, bias):
    x, w, b = make(M, N, K, dtype, bias)
    out = run_triton(x, w, b, cfg)
    ref = row_linear_reference(x, w, b, compute_dtype=torch.float64)
    assert out.dtype == dtype and out.shape == (M, N)
    assert rel_err(out, ref) < REL_ERR[dtype]


INVARIANCE = [
    pytest.param(torch.bfloat16, config(), True, id="bf16-bias"),
    pytest.param(torch.float16, config(16, 16, 32, group_m=3), False, id="f16-group3"),
    pytest.param(torch.float32, config(32, 32, 32, group_m=2), True, id="f32-bias-block32"),
]


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype, cfg, bias", INVARIANCE)
def test_triton_rows_are_batch_invariant(dtype, cfg, bias):
    """The same 130 rows computed alone, in prefixes of M = 7, 64, 130 rows, and shuffled among
    random neighbours: identical bits."""
    x, w, b = make(130, 40, 72, dtype, bias, seed=1)
    alone = torch.cat([run_triton(x[i:i + 1].clone(), w, b, cfg) for i in range(130)])
    assert rel_err(alone, row_linear_reference(x, w, b, compute_dtype=torch.float64)) < REL_ERR[dtype]
    for M in (7, 64, 130):
        assert torch.equal(run_triton(x[:M], w, b, cfg), alone[:M]), f"M={M}: rows differ from the one-row calls"
    g = torch.Generator().manual_seed(2)
    order = torch.randperm(130, generator=g)[:50]
    strangers = make(30, 40, 72, dtype, seed=3)[0] * 4                 # other rows, other magnitudes
    mixed = torch.cat([x[order], strangers])[torch.randperm(80, generator=g)]
    out = run_triton(mixed, w, b, cfg)
    for i in range(80):
        hits = (x == mixed[i]).all(1).nonzero()
        if len(hits):
            assert torch.equal(out[i], alone[hits[0, 0]]), f"row {i} changed beside other neighbours"


@needs_triton
@pytest.mark.triton
def test_public_triton_backend_uses_the_shape_config():
    x, w, b = make(9, 48, 64, torch.bfloat16, bias=True)
    out = row_linear(x, w, b, backend="triton")
    assert rel_err(out, row_linear_reference(x, w, b, compute_dtype=torch.float64)) < REL_ERR[torch.bfloat16]
    assert torch.equal(row_linear(x[4:5].clone(), w, b, backend="triton")[0], out[4])


def test_configs_come_from_the_shape_alone():
    from batchd.kernels.row_gemm.triton_kernel import TUNED, RowGemmConfig, choose_config

    assert choose_config(4096, 4096, torch.bfloat16) == TUNED[(4096, 4096, 2)]
    assert choose_config(4096, 4096, torch.float16) == TUNED[(4096, 4096, 2)]
    assert choose_config(1000, 72, torch.float32) == RowGemmConfig(64, 64, 32, group_m=8, num_warps=4, num_stages=3)
    assert choose_config(151936, 1536, torch.bfloat16) == RowGemmConfig(64, 128, 64, group_m=8, num_stages=4)
    with pytest.raises(ValueError, match="power of two"):
        RowGemmConfig(48, 64, 64)
    with pytest.raises(ValueError, match="power of two"):
        RowGemmConfig(64, 64, 8)


BAD = [
    pytest.param((4,), (8, 4), None, "expected x", id="x-1d"),
    pytest.param((2, 4), (8, 5), None, "differ in K", id="k-mismatch"),
    pytest.param((0, 4), (8, 4), None, "at least one row", id="no-rows"),
    pytest.param((2, 4), (0, 4), None, "non-empty", id="no-outputs"),
    pytest.param((2, 4), (8, 4), (7,), "bias must have shape", id="bias-shape"),
]


@pytest.mark.parametrize("x_shape, w_shape, b_shape, message", BAD)
def test_bad_shapes_raise(x_shape, w_shape, b_shape, message):
    x, w = torch.randn(*x_shape), torch.randn(*w_shape)
    b = None if b_shape is None else torch.randn(*b_shape)
    with pytest.raises(ValueError, match=message):
        row_linear(x, w, b)


def test_bad_dtypes_layouts_and_backend_raise():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="share one dtype"):
        row_linear(x, w.half())
    with pytest.raises(ValueError, match="share one dtype"):
        row_linear(x.double(), w.double())
    with pytest.raises(ValueError, match="bias must have x's dtype"):
        row_linear(x, w, torch.randn(4).half())
    with pytest.raises(ValueError, match="bias must be contiguous"):
        row_linear(x, w, torch.randn(8)[::2])
    with pytest.raises(ValueError, match="contiguous"):
        row_linear(torch.randn(8, 2).t(), w)
    with pytest.raises(ValueError, match="contiguous"):
        row_linear(x, torch.randn(8, 4).t())
    with pytest.raises(ValueError, match="backend must be one of"):
        row_linear(x, w, backend="cublas")


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU smoke test (the GPU session runs the bench itself)")
def test_bench_runs_its_cpu_smoke_test(capsys):
    """bench/row_gemm.py --device cpu --small: the table, the whole-step estimate and a sweep."""
    from bench import row_gemm

    row_gemm.main(["--device", "cpu", "--small", "--rows", "5", "40"])
    row_gemm.main(["--device", "cpu", "--small", "--sweep", "--shapes", "down"])
    out = capsys.readouterr().out
    assert "whole-step projections" in out and "| NO" not in out and out.count("| yes") == 10
    assert "(64, 112, 2): RowGemmConfig(" in out


def compile_table_for_hopper() -> dict:
    """Registers, spills and shared memory of every TUNED config (and the heuristic's for a ragged
    f32 / f16 shape with a bias) compiled for sm_90 with bench/kernel_resources.py. Needs
    TRITON_INTERPRET unset, no GPU. -> {case: resources}"""
    from bench import kernel_resources as kr
    from batchd.kernels.row_gemm import triton_kernel as rk

    cases = {f"{N}x{K} bf16": (N, K, torch.bfloat16, False) for N, K, _ in rk.TUNED}
    cases.update({"1000x1000 f32 bias": (1000, 1000, torch.float32, True),
                  "1000x1000 f16 bias": (1000, 1000, torch.float16, True)})
    out = {}
    for name, (N, K, dtype, bias) in cases.items():
        cfg, ty = rk.choose_config(N, K, dtype), {torch.bfloat16: "*bf16", torch.float16: "*fp16"}.get(dtype, "*fp32")
        pointers = dict(X=ty, W=ty, Bias=ty, Out=ty)
        consts = dict(HAS_BIAS=bias, EVEN_K=K % cfg.block_k == 0, UPCAST_DOT=False,
                      DOT_PRECISION=rk.dot_flags(dtype)[1],
                      BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m)
        out[name] = kr.resources(cfg, consts, fn=rk._row_gemm_kernel, pointers=pointers,
                                 divisible=set(pointers) | {"N", "K", "stride_xm", "stride_wn", "stride_om"})
    return out


@needs_triton
def test_table_configs_compile_for_hopper_without_spills():
    """What the interpreter never checks: each config compiles for sm_90, spills no registers and
    leaves room for two programs a multiprocessor at least (a step's m tiles of one weight tile
    then run side by side)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import json; from tests.kernels.test_row_gemm import compile_table_for_hopper as c; "
            "print(json.dumps(c()))")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                          env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    resources = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(resources) == 7
    for name, used in resources.items():
        assert used["spill_stack_bytes"] == 0 and used["ctas_per_sm"] >= 2, f"{name}: {used}"


# ----------------------------------------------------------------------------------- CUDA only

LLAMA_8B = [  # (N, K) of Llama-3-8B's projections (lm_head: 128256 x 4096, 1 GB, left to the bench)
    pytest.param(6144, 4096, id="qkv"),
    pytest.param(4096, 4096, id="o"),
    pytest.param(28672, 4096, id="gate_up"),
    pytest.param(4096, 14336, id="down"),
    pytest.param(1000, 1000, id="ragged-1000"),
]


@needs_cuda
@needs_triton
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("N, K", LLAMA_8B)
def test_cuda_8b_shapes_are_invariant_for_m_1_to_512(N, K, bias):
    x, w, b = make(512, N, K, torch.bfloat16, bias, seed=2)
    full = row_linear(x, w, b)
    assert rel_err(full, row_linear_reference(x, w, b, compute_dtype=torch.float64)) < REL_ERR[torch.bfloat16]
    assert rel_err(full, torch.nn.functional.linear(x, w, b)) < REL_ERR[torch.bfloat16]
    for i in (0, 1, 63, 64, 200, 511):
        assert torch.equal(row_linear(x[i:i + 1].clone(), w, b)[0], full[i]), f"row {i} alone"
    for M in range(1, 513):
        assert torch.equal(row_linear(x[:M], w, b), full[:M]), f"M={M}"
    order = torch.randperm(512, generator=torch.Generator().manual_seed(4)).to(x.device)
    assert torch.equal(row_linear(x[order], w, b), full[order])


@needs_cuda
@needs_triton
def test_cuda_graph_capture_replays_the_same_bits():
    x, w, b = make(200, 4096, 4096, torch.bfloat16, bias=True, seed=3)
    row_linear(x, w, b)                                        # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = row_linear(x, w, b)
    x.copy_(make(200, 4096, 4096, torch.bfloat16, seed=4)[0])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, row_linear(x, w, b))
