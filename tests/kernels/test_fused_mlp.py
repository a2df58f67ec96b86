"""fused_mlp: the Triton kernels against the reference twin, rows bitwise independent of M, and the
same act rows as kernels.small_matmul's gated projection.

On CPU the Triton cases run under TRITON_INTERPRET=1 (conftest) with small shapes whose slices are
ragged (I not a multiple of the program count), with and without a remainder tile and emitted norm
inputs, and a second block of 16 rows (M = 17). On CUDA the same tests run compiled, plus the
model shapes with their tuned configs inside a CUDA graph.
"""
from __future__ import annotations

import pytest
import torch

from batchd.kernels.fused_mlp import check_mlp_inputs, fused_mlp, fused_mlp_reference, fused_mlp_wanted
from batchd.kernels.small_matmul.reference import norm_inputs_reference
from tests.kernels.conftest import DEVICE, REL_ERR, needs_triton, rel_err

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make(M, H, I, dtype, seed=0, device=DEVICE):
    """(x, row_sumsq, gate_up, down_t, residual, norm weight): a post-attention norm's inputs and weights."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(M, H, generator=g).to(dtype)
    post = norm_inputs_reference(h, (1 + 0.1 * torch.randn(H, generator=g)).to(dtype))
    gate_up = (torch.randn(2 * I, H, generator=g) / H**0.5).to(dtype)
    down_t = (torch.randn(I, H, generator=g) / I**0.5).to(dtype)
    residual = (0.1 * torch.randn(M, H, generator=g)).to(dtype)     # small: the product dominates out
    next_norm = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    to = lambda t: t.to(device)  # noqa: E731
    return to(post.weighted), to(post.sumsq), to(gate_up), to(down_t), to(residual), to(next_norm)


def config(programs, block=32, remainder=True):
    from batchd.kernels.fused_mlp.triton_kernel import FusedMlpConfig

    return FusedMlpConfig(programs=programs, block_k=block, block_n=block, num_stages=2, reduce_block=32,
                          remainder=remainder)


def test_reference_is_gated_projection_then_down():
    x, sumsq, gate_up, down_t, residual, _ = make(3, 32, 40, torch.float32, device="cpu")
    scale = torch.rsqrt(sumsq.sum(0) / 32 + 1e-6)
    gate, up = ((x.double() @ gate_up.double().t()) * scale.double()[:, None]).chunk(2, dim=-1)
    want = residual.double() + (torch.nn.functional.silu(gate) * up) @ down_t.double()
    assert rel_err(fused_mlp_reference(x, sumsq, gate_up, down_t, residual), want) < 1e-5


# (M, H, I, programs, remainder): slices shorter than the 16-row tile (13-14 rows), slices of 25 rows
# as a 16-row tile + a 16-row remainder tile holding 9, slices of 35 as 32 + 16 (3 rows) or as one
# padded 64-row tile, a second m block
CASES = [
    pytest.param(1, 64, 40, 3, True, id="m1-h64-i40-p3-short"),
    pytest.param(5, 64, 100, 4, True, id="m5-h64-i100-p4-main16-rem16"),
    pytest.param(17, 96, 140, 4, True, id="m17-h96-i140-p4-main32-rem16"),
    pytest.param(17, 64, 140, 4, False, id="m17-h64-i140-p4-padded64"),
]


def test_slices_take_a_full_main_tile_and_a_remainder():
    tiles = lambda I, P, remainder=True: config(P, remainder=remainder).tiles(I, P)  # noqa: E731
    assert tiles(8960, 132) == (64, 16)            # Qwen2.5-1.5B: 67-68 rows
    assert tiles(8960, 132, remainder=False) == (128, 0)
    assert tiles(4864, 76) == (64, 0)              # Qwen2.5-0.5B's table: exactly 64 rows
    assert tiles(14336, 132) == (64, 64)           # Llama-3-8B: 108-109 rows
    assert tiles(1536, 132) == (16, 0)             # SmolLM2-135M: 11-12 rows in one masked tile


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("emit", [False, True], ids=["plain", "emit"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("M, H, I, programs, remainder", CASES)
def test_triton_matches_reference(M, H, I, programs, remainder, dtype, emit):
    x, sumsq, gate_up, down_t, residual, next_norm = make(M, H, I, dtype)
    kwargs = dict(residual=residual, eps=1e-6, emit_norm_weight=next_norm if emit else None)
    got = fused_mlp(x, sumsq, gate_up, down_t, backend="triton", config=config(programs, remainder=remainder),
                    **kwargs)
    want = fused_mlp(x, sumsq, gate_up, down_t, backend="reference", **kwargs)
    if emit:
        (got, got_inputs), (want, want_inputs) = got, want
        assert rel_err(got_inputs.weighted, want_inputs.weighted) < 2 * REL_ERR[dtype]
        # a sum of squares doubles its terms' relative error
        assert rel_err(got_inputs.sumsq.sum(0), want_inputs.sumsq.sum(0)) < 4 * REL_ERR[dtype]
    # twice the bound of one product: act's roundings (gate, up, silu) flip where the sums' order moves
    assert rel_err(got, want) < 2 * REL_ERR[dtype]


@needs_triton
@pytest.mark.triton
def test_rows_do_not_depend_on_how_many_are_computed_together():
    x, sumsq, gate_up, down_t, residual, next_norm = make(17, 64, 100, torch.bfloat16, seed=1)
    run = lambda rows: fused_mlp(x[rows], sumsq[:, rows].contiguous(), gate_up, down_t,  # noqa: E731
                                 residual=residual[rows], emit_norm_weight=next_norm, backend="triton",
                                 config=config(4))                                     # a remainder tile
    full, full_inputs = run(slice(0, 17))
    for rows in (slice(0, 1), slice(3, 8), slice(16, 17)):
        out, inputs = run(rows)
        assert torch.equal(out, full[rows])
        assert torch.equal(inputs.weighted, full_inputs.weighted[rows])


@needs_triton
@pytest.mark.triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter only: compiled, two k-step sizes may sum apart")
def test_act_rows_match_the_gated_projection():
    """The slice's silu(gate) * up is the gated small_linear's, bit for bit (the same k steps in the
    interpreter), so the fused and chained MLPs differ only in how down's sums are ordered: with
    down = identity rows the outputs agree."""
    from batchd.kernels.small_matmul import small_linear

    M, H = 3, 64
    x, sumsq, gate_up, _, residual, _ = make(M, H, H, torch.float32, seed=2)
    down_t = torch.eye(H, device=x.device)        # act Wd^T = act
    act = small_linear(x, gate_up, row_sumsq=sumsq, eps=1e-6, gated=True, backend="triton")   # one k step
    out = fused_mlp(x, sumsq, gate_up, down_t, residual=torch.zeros_like(residual), backend="triton",
                    config=config(4, block=64))                                         # main 16 rows
    assert torch.equal(out, act)


@needs_triton
def test_the_engine_takes_the_kernel_where_it_measured_faster(use_options):
    bf16 = torch.bfloat16
    use_options(fused_mlp=None)
    assert fused_mlp_wanted(896, 4864, bf16)              # Qwen2.5-0.5B: in the table
    assert not fused_mlp_wanted(1536, 8960, bf16)         # Qwen2.5-1.5B: the chain measured faster
    use_options(fused_mlp=True)                           # BATCHD_FUSED_MLP=1
    assert fused_mlp_wanted(1536, 8960, bf16) and not fused_mlp_wanted(1000, 8960, bf16)   # H % 16
    use_options(fused_mlp=False)                          # BATCHD_FUSED_MLP=0
    assert not fused_mlp_wanted(896, 4864, bf16)


def test_bad_operands_name_the_numbers():
    x, sumsq, gate_up, down_t, residual, _ = make(2, 32, 40, torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"down_t must be .* \[40, 32\]"):
        check_mlp_inputs(x, sumsq, gate_up, down_t.t().contiguous(), residual, None)
    with pytest.raises(ValueError, match="down_t must be"):
        check_mlp_inputs(x, sumsq, gate_up, down_t.t().contiguous().t(), residual, None)   # strided view
    with pytest.raises(ValueError, match="row_sumsq is required"):
        check_mlp_inputs(x, None, gate_up, down_t, residual, None)
    with pytest.raises(ValueError, match="residual must be"):
        check_mlp_inputs(x, sumsq, gate_up, down_t, residual[:1], None)


@needs_cuda
@pytest.mark.parametrize("shape", [(1536, 8960), (4096, 14336), (576, 1536)], ids=["qwen2.5-1.5b", "llama-3-8b",
                                                                                    "smollm2-135m"])
def test_cuda_model_shapes_in_a_graph(shape):
    H, I = shape
    x, sumsq, gate_up, down_t, residual, next_norm = make(5, H, I, torch.bfloat16)
    run = lambda: fused_mlp(x, sumsq, gate_up, down_t, residual=residual, emit_norm_weight=next_norm)  # noqa: E731
    eager, _ = run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, _ = run()
    graph.replay()
    want = fused_mlp_reference(x, sumsq, gate_up, down_t, residual)
    assert torch.equal(captured, eager)
    assert rel_err(eager, want) < 2 * REL_ERR[torch.bfloat16]
    one, _ = fused_mlp(x[:1], sumsq[:, :1].contiguous(), gate_up, down_t, residual=residual[:1],
                       emit_norm_weight=next_norm)
    assert torch.equal(one, eager[:1])


# ---- the bulk-copy stream kernel (kernels/fused_mlp/stream_mlp.cu) ----

def stream_config(ring_kb=128):
    from batchd.kernels.fused_mlp.triton_kernel import FusedMlpConfig

    return FusedMlpConfig(stream=True, ring_kb=ring_kb)


@pytest.mark.parametrize("M, I, H", [(1, 8960, 1536), (17, 8960, 1536), (32, 8960, 1536), (17, 14336, 4096),
                                     (1, 1536, 576), (3, 40, 64)])
def test_stream_plan_fits_shared_memory_and_covers_every_row(M, I, H):
    from batchd.kernels.fused_mlp.stream_kernel import COLUMNS_PER_THREAD_GROUP, plan_stream_mlp
    from batchd.kernels.stream_linear import MAX_SHARED_MEM

    p = plan_stream_mlp(M, I, H, 2, sms=132, ring_bytes=128 << 10)
    assert p.grid == min(132, I) and p.m_bucket >= M
    assert 2 <= p.num_slots <= 16 and p.shared_mem <= MAX_SHARED_MEM
    assert 8 % p.chunk_units == 0 and p.slot_bytes == p.chunk_units * 2 * H * 2
    assert p.col_groups * COLUMNS_PER_THREAD_GROUP >= H       # every output column has a thread
    bounds = [b * I // p.grid for b in range(p.grid + 1)]
    assert bounds[-1] == I and all(hi > lo for lo, hi in zip(bounds, bounds[1:]))


def test_stream_plan_refuses_what_the_kernel_cannot_run():
    from batchd.kernels.fused_mlp.stream_kernel import plan_stream_mlp

    with pytest.raises(ValueError, match="1..32 rows"):
        plan_stream_mlp(33, 64, 64, 2, sms=4, ring_bytes=1 << 16)
    with pytest.raises(ValueError, match="multiple of 8"):
        plan_stream_mlp(1, 64, 60, 2, sms=4, ring_bytes=1 << 16)
    with pytest.raises(ValueError, match="does not fit"):
        plan_stream_mlp(1, 64, 40000, 2, sms=4, ring_bytes=1 << 16)


def test_stream_args_struct_matches_the_kernels_layout():
    import ctypes

    from batchd.kernels.fused_mlp.stream_kernel import _MlpArgs

    # 5 pointers, 4 ints, a float, 4 ints, the trace pointer (8-aligned) and its row -> 96 bytes
    assert _MlpArgs.eps.offset == 5 * 8 + 4 * 4
    assert _MlpArgs.trace.offset == 80 and ctypes.sizeof(_MlpArgs) == 96


def _sm90():
    from batchd.kernels.stream_linear import cuda_supported

    return torch.cuda.is_available() and cuda_supported(torch.device("cuda"))


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="needs an sm_90+ GPU (bulk copies, griddepcontrol)")


@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("M, H, I, ring_kb", [
    (1, 1536, 8960, 128),    # Qwen2.5-1.5B: 4 pairs a chunk, 5 slots (slot 4 idle in the gate/up phase)
    (17, 1536, 8960, 192),   # a verify step, 8 slots
    (32, 1536, 8960, 48),    # 2 slots: one per consumer group, x read from global memory
    (5, 4096, 14336, 192),   # Llama-3-8B: one pair a chunk, 8 groups, two column groups a thread
    (3, 576, 1536, 72),      # SmolLM2-135M: 8 pairs a chunk, 11-12 rows a CTA, 4 slots
    (2, 64, 40, 8),          # fewer rows than multiprocessors: one row a CTA
])
def test_stream_kernel_matches_reference_and_its_rows_are_batch_invariant(M, H, I, ring_kb, dtype):
    x, sumsq, gate_up, down_t, residual, next_norm = make(M, H, I, dtype, seed=M)
    run = lambda rows: fused_mlp(x[rows], sumsq[:, rows].contiguous(), gate_up, down_t,  # noqa: E731
                                 residual=residual[rows], emit_norm_weight=next_norm, config=stream_config(ring_kb))
    got, got_inputs = run(slice(0, M))
    want, want_inputs = fused_mlp_reference(x, sumsq, gate_up, down_t, residual, emit_norm_weight=next_norm)
    assert rel_err(got, want) < 2 * REL_ERR[dtype]
    assert rel_err(got_inputs.weighted, want_inputs.weighted) < 2 * REL_ERR[dtype]
    for rows in {slice(0, 1), slice(M - 1, M), slice(M // 2, M)}:
        out, inputs = run(rows)
        assert torch.equal(out, got[rows]) and torch.equal(inputs.weighted, got_inputs.weighted[rows])
    again, _ = run(slice(0, M))
    assert torch.equal(again, got)                      # no race: the same bits every launch


@needs_sm90
def test_stream_kernel_in_a_cuda_graph_and_beside_the_triton_slices():
    x, sumsq, gate_up, down_t, residual, _ = make(5, 1536, 8960, torch.bfloat16, seed=7)
    run = lambda: fused_mlp(x, sumsq, gate_up, down_t, residual=residual, config=stream_config())  # noqa: E731
    eager = run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    graph.replay()
    assert torch.equal(captured, eager)
    triton_out = fused_mlp(x, sumsq, gate_up, down_t, residual=residual)       # the Triton slices
    assert rel_err(eager, triton_out) < 2 * REL_ERR[torch.bfloat16]
