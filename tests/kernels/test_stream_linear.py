"""kernels.stream_linear: the launch plan and the reference route everywhere; the CUDA kernel on an
sm_90+ GPU (against small_linear_reference, batch invariance, the emitted norm inputs, CUDA graphs,
and the routing from small_linear's table)."""
from __future__ import annotations

import ctypes

import pytest
import torch

from batchd.kernels.small_matmul.reference import rms_scale, small_linear_reference
from batchd.kernels.stream_linear import MAX_SHARED_MEM, _Args, cuda_supported, plan, stream_linear
from tests.kernels.conftest import REL_ERR, rel_err

SM90 = torch.cuda.is_available() and cuda_supported(torch.device("cuda"))
needs_sm90 = pytest.mark.skipif(not SM90, reason="needs an sm_90+ GPU (bulk copies, griddepcontrol)")


def test_args_struct_matches_the_kernels_layout():
    # stream_linear.cu's struct Args: 9 pointers, 4 ints, a float, 5 ints, the trace pointer and its
    # row (124 bytes, padded to 8), then rope's 6 pointers, 6 strides and 5 ints -> 244, padded to 248
    assert ctypes.sizeof(_Args) == 248 and _Args.rope_early.offset == 240
    assert _Args.eps.offset == 9 * 8 + 4 * 4
    assert _Args.trace.offset == 112 and _Args.rope_cos.offset == 128 and _Args.T.offset == 224


@pytest.mark.parametrize("M,N,K,gated,emit", [
    (1, 8960, 1536, True, False),     # Qwen2.5-1.5B gate/up: 4 pairs (24 KB) a chunk
    (17, 1536, 8960, False, True),    # its down: one 17.5 KB row a chunk
    (1, 151936, 1536, False, False),  # its lm_head: 8 rows a chunk
    (17, 4096, 14336, False, True),   # Llama-3-8B down: 28 KB rows, still two slots or more
    (3, 7, 64, False, False),         # fewer units than multiprocessors: one CTA each
])
def test_plan_fits_shared_memory_and_covers_every_unit(M, N, K, gated, emit):
    p = plan(M, N, K, 2, gated=gated, emit=emit, sms=132)
    assert p.grid == min(132, N)
    assert p.num_slots >= 2 and p.shared_mem <= MAX_SHARED_MEM
    assert 8 % p.chunk_units == 0 and p.slot_bytes == p.chunk_units * K * 2 * (2 if gated else 1)
    assert p.m_bucket >= M
    # every CTA owns at least one unit, and the shares tile [0, N)
    bounds = [b * N // p.grid for b in range(p.grid + 1)]
    assert bounds[0] == 0 and bounds[-1] == N and all(hi > lo for lo, hi in zip(bounds, bounds[1:]))


def test_plan_bounds_its_ctas_and_pads_its_shared_memory():
    """max_ctas caps the grid; min_shared_bytes raises the request (past half an SM's shared memory no
    two CTAs share it) and never past the limit. Qwen2.5-1.5B's qkv as the table runs it: 128 CTAs
    of two 4-pair chunks each, 114 KB asked."""
    base = plan(1, 1024, 1536, 2, gated=False, emit=False, sms=132, ring_bytes=96 << 10, rope_half=64)
    bounded = plan(1, 1024, 1536, 2, gated=False, emit=False, sms=132, ring_bytes=96 << 10, rope_half=64,
                   min_shared_bytes=114 << 10, max_ctas=128)
    assert base.grid == 132 and base.shared_mem < 114 << 10
    assert bounded.grid == 128 and 1024 // bounded.chunk_units == 2 * bounded.grid
    assert bounded.shared_mem == 114 << 10 and bounded.num_slots == base.num_slots
    assert plan(1, 64, 64, 2, gated=False, emit=False, sms=4, min_shared_bytes=1 << 30).shared_mem == MAX_SHARED_MEM


def test_config_fields_of_a_stream_launch_need_a_stream_config():
    from batchd.kernels.small_matmul.triton_kernel import SmallLinearConfig

    with pytest.raises(ValueError, match="set stream=True"):
        SmallLinearConfig(16, 128, 1, stream_max_ctas=128)
    with pytest.raises(ValueError, match=">= 0"):
        SmallLinearConfig(16, 128, 1, stream=True, stream_min_kb=-1)


def test_plan_refuses_what_the_kernel_cannot_run():
    with pytest.raises(ValueError, match="1..32 rows"):
        plan(33, 64, 64, 2, gated=False, emit=False, sms=4)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        plan(1, 64, 60, 2, gated=False, emit=False, sms=4)
    with pytest.raises(ValueError, match="does not fit"):
        plan(1, 64, 64 * 1024, 2, gated=False, emit=False, sms=4)


def test_reference_route_off_the_gpu_is_small_linear_reference():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    w = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    sumsq = torch.rand(2, 3, generator=gen) * 64
    out = stream_linear(x, w, row_sumsq=sumsq, gated=True, backend="reference")
    assert torch.equal(out, small_linear_reference(x, w, row_sumsq=sumsq, gated=True))
    if not SM90:
        assert torch.equal(stream_linear(x, w, row_sumsq=sumsq, gated=True), out)   # "auto" falls back
        with pytest.raises(ValueError, match="sm_90"):
            stream_linear(x, w, backend="cuda")


def _inputs(M, N, K, fusion, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = 2 * N if fusion == "gated" else N
    w = (torch.randn(rows, K, generator=gen, device="cuda") * K**-0.5).to(dtype)
    x = torch.randn(M, K, generator=gen, device="cuda").to(dtype)
    kwargs = {}
    if fusion == "bias":
        kwargs["bias"] = torch.randn(N, generator=gen, device="cuda").to(dtype)
    if fusion == "gated":
        kwargs.update(gated=True, row_sumsq=torch.rand(3, M, generator=gen, device="cuda") * K)
    if fusion == "residual":
        kwargs.update(residual=torch.randn(M, N, generator=gen, device="cuda").to(dtype),
                      emit_norm_weight=torch.randn(N, generator=gen, device="cuda").to(dtype))
    return x, w, kwargs


def _rows(kwargs, lo, hi):
    """The kwargs of rows lo..hi of a call."""
    return {k: v[lo:hi] if k == "residual" else v[:, lo:hi].contiguous() if k == "row_sumsq" else v
            for k, v in kwargs.items()}


def _out(result):
    return result[0] if isinstance(result, tuple) else result


SHAPES = [(64, 256, "plain"), (200, 1536, "bias"), (96, 1536, "gated"), (300, 8960, "residual"), (1000, 72, "plain")]


@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,K,fusion", SHAPES)
@pytest.mark.parametrize("M", [1, 5, 17, 32])
def test_kernel_matches_the_reference(M, N, K, fusion, dtype):
    x, w, kwargs = _inputs(M, N, K, fusion, dtype)
    got, want = stream_linear(x, w, **kwargs), small_linear_reference(x, w, **kwargs)
    assert rel_err(_out(got), _out(want)) < REL_ERR[dtype]
    if fusion == "residual":
        assert rel_err(got[1].weighted, want[1].weighted) < REL_ERR[dtype]
        assert got[1].sumsq.shape[1] == M
        # the parts add up to the rows' sums of squares, and they feed rms_scale as any NormInputs do
        torch.testing.assert_close(rms_scale(got[1].sumsq, N, 1e-6), rms_scale(want[1].sumsq, N, 1e-6),
                                   rtol=1e-2, atol=0)


@needs_sm90
@pytest.mark.parametrize("N,K,fusion", SHAPES)
def test_rows_equal_one_row_calls_bit_for_bit(N, K, fusion):
    """A verify step's rows (M = 17, and 32, another M bucket) equal the decode steps' one-row calls."""
    for M in (17, 32):
        x, w, kwargs = _inputs(M, N, K, fusion, torch.bfloat16, seed=M)
        full = stream_linear(x, w, **kwargs)
        for m in (0, 7, M - 1):
            alone = stream_linear(x[m:m + 1], w, **_rows(kwargs, m, m + 1))
            assert torch.equal(_out(alone)[0], _out(full)[m]), (M, m)
            if fusion == "residual":
                assert torch.equal(alone[1].weighted[0], full[1].weighted[m])
        few = stream_linear(x[:3], w, **_rows(kwargs, 0, 3))   # bucket 4 against bucket 17 or 32
        assert torch.equal(_out(few), _out(full)[:3])


@needs_sm90
@pytest.mark.parametrize("ring_kb", [40, 64, 96])
def test_a_ring_of_fewer_slots_than_consumer_groups(ring_kb):
    """K = 8960 rows are one unit a chunk, so eight one-warp groups; a 40-96 KB ring holds 2-5 slots.
    The groups past the slot count idle (a parity wait cannot tell a slot's chunk c from c + 2S)."""
    x, w, kwargs = _inputs(17, 300, 8960, "residual", torch.bfloat16)
    got = stream_linear(x, w, ring_bytes=ring_kb * 1024, **kwargs)
    assert torch.equal(got[0], stream_linear(x, w, **kwargs)[0])
    assert rel_err(got[0], small_linear_reference(x, w, **kwargs)[0]) < REL_ERR[torch.bfloat16]


@needs_sm90
def test_a_residual_with_padded_rows_reads_as_its_values():
    """The checks accept a residual whose rows are strided (stride(1) == 1 only); the kernel reads
    rows at a pitch of N, so the wrapper hands it a contiguous copy."""
    x, w, kwargs = _inputs(3, 300, 1536, "residual", torch.bfloat16)
    padded = torch.zeros(3, 320, dtype=torch.bfloat16, device="cuda")
    padded[:, :300] = kwargs["residual"]
    got = stream_linear(x, w, **{**kwargs, "residual": padded[:, :300]})
    assert torch.equal(got[0], stream_linear(x, w, **kwargs)[0])


@needs_sm90
def test_kernel_replays_in_a_cuda_graph():
    x, w, kwargs = _inputs(1, 8960, 1536, "gated", torch.bfloat16)
    static_x = x.clone()
    eager = stream_linear(static_x, w, **kwargs)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        stream_linear(static_x, w, **kwargs)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        captured = stream_linear(static_x, w, **kwargs)
    new_x = torch.randn_like(x)
    static_x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, stream_linear(new_x, w, **kwargs))
    assert not torch.equal(captured, eager)


@needs_sm90
def test_trace_rows_hold_each_ctas_start_wait_and_end():
    from batchd.kernels import _trace

    x, w, kwargs = _inputs(1, 300, 1536, "gated", torch.bfloat16)
    with _trace.recording(x.device) as recorder:
        traced = stream_linear(x, w, **kwargs)
    torch.cuda.synchronize()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    (launch,) = recorder.launches
    assert launch.label == "stream 300x1536 gated" and launch.programs == min(sms, 300)
    rows = recorder.rows[launch.first_row:launch.first_row + launch.programs].cpu()
    start, waited, end, sm = rows.unbind(1)
    assert (start > 0).all() and (waited >= start).all() and (end >= waited).all()
    assert (sm >= 0).all() and (sm < sms).all()
    assert torch.equal(traced, stream_linear(x, w, **kwargs))   # the marks change no value


@needs_sm90
def test_small_linear_routes_a_stream_config_to_the_kernel():
    from batchd.kernels.small_matmul import small_linear
    from batchd.kernels.small_matmul.triton_kernel import SmallLinearConfig, small_linear_triton

    x, w, kwargs = _inputs(2, 300, 8960, "residual", torch.bfloat16)
    routed = small_linear_triton(x, w, None, config=SmallLinearConfig(16, 128, 1, stream=True), **kwargs)
    direct = stream_linear(x, w, **kwargs)
    assert torch.equal(routed[0], direct[0]) and torch.equal(routed[1].sumsq, direct[1].sumsq)
    tiles = small_linear(x, w, **kwargs)   # the table's Triton config for this shape: same maths
    assert rel_err(tiles[0], direct[0]) < REL_ERR[torch.bfloat16]


@needs_sm90
@pytest.mark.parametrize("N,K,fusion", SHAPES)
def test_a_trigger_at_the_start_changes_no_bit(N, K, fusion):
    """trigger_at_start (a stream config's trigger 0) moves only where the next launch may start."""
    from batchd.kernels.small_matmul.triton_kernel import SmallLinearConfig, small_linear_triton

    x, w, kwargs = _inputs(5, N, K, fusion, torch.bfloat16, seed=3)
    early = stream_linear(x, w, trigger_at_start=True, **kwargs)
    assert torch.equal(_out(early), _out(stream_linear(x, w, **kwargs)))
    routed = small_linear_triton(x, w, kwargs.pop("bias", None), config=SmallLinearConfig(16, 128, 1, stream=True,
                                                                                         trigger=0), **kwargs)
    assert torch.equal(_out(routed), _out(early))


@needs_sm90
@pytest.mark.parametrize("N,K,fusion", SHAPES)
def test_fewer_ctas_and_a_padded_request_change_no_bit(N, K, fusion):
    """max_ctas and min_shared_bytes move units between CTAs and CTAs between SMs, never a value
    (a unit's arithmetic is its own; the emitted sums of squares have one part a CTA, so only their
    total is compared)."""
    x, w, kwargs = _inputs(5, N, K, fusion, torch.bfloat16, seed=4)
    want = stream_linear(x, w, **kwargs)
    got = stream_linear(x, w, min_shared_bytes=114 << 10, max_ctas=37, **kwargs)
    assert torch.equal(_out(got), _out(want))
    if fusion == "residual":
        assert torch.equal(got[1].weighted, want[1].weighted) and got[1].sumsq.shape[0] == 37
        torch.testing.assert_close(got[1].sumsq.sum(0), want[1].sumsq.sum(0), rtol=1e-5, atol=0)


# ---- rope: the q/k/v projection of a decode or verify step (Qwen2.5-1.5B's heads, and a small layout) ----

def _rope_case(T, heads, kv_heads, D, K, device, seed=0, dtype=torch.bfloat16):
    """(x, weight, kwargs, RopeTarget) for a [1, T] step at positions 40.. of zeroed caches."""
    from batchd.kernels.small_matmul.triton_kernel import RopeTarget

    gen = torch.Generator(device=device).manual_seed(seed)
    rows = (heads + 2 * kv_heads) * D
    w = (torch.randn(rows, K, generator=gen, device=device) * K**-0.5).to(dtype)
    x = torch.randn(T, K, generator=gen, device=device).to(dtype)
    kwargs = dict(bias=torch.randn(rows, generator=gen, device=device).to(dtype),
                  row_sumsq=torch.rand(3, T, generator=gen, device=device) * K)
    positions = torch.arange(40, 40 + T, device=device)
    theta = positions[:, None].float() * (10000.0 ** (-torch.arange(0, D, 2, device=device).float() / D))
    cos, sin = torch.cat([theta.cos()] * 2, -1), torch.cat([theta.sin()] * 2, -1)       # [T, D] f32
    caches = [torch.zeros(1, kv_heads, 64, D, dtype=dtype, device=device) for _ in range(2)]
    return x, w, kwargs, RopeTarget(cos, sin, positions, *caches, heads, kv_heads)


def test_rope_plan_takes_whole_chunks_of_one_head():
    p = plan(1, 1024, 1536, 2, gated=False, emit=False, sms=132, ring_bytes=48 << 10, rope_half=64)
    assert p.chunk_units == 4 and 64 % p.chunk_units == 0 and p.grid == 132     # Qwen2.5-1.5B: 256 chunks
    p = plan(3, 96, 64, 2, gated=False, emit=False, sms=132, ring_bytes=8 << 10, rope_half=8)
    assert p.chunk_units == 8 and p.grid == 12                                  # one chunk a CTA
    with pytest.raises(ValueError, match="whole heads"):
        plan(1, 100, 64, 2, gated=False, emit=False, sms=4, rope_half=64)
    with pytest.raises(ValueError, match="no other fusion"):
        plan(1, 128, 64, 2, gated=True, emit=False, sms=4, rope_half=64)


def test_rope_reference_route_is_the_projection_then_rope_cache():
    from batchd.kernels.rope_cache import rope_and_store

    x, w, kwargs, rope = _rope_case(3, 4, 2, 16, 64, "cpu")
    q = stream_linear(x, w, **kwargs, rope=rope, backend="reference")
    qkv = small_linear_reference(x, w, **kwargs)
    k_cache, v_cache = rope.k_cache.clone().zero_(), rope.v_cache.clone().zero_()
    want = rope_and_store(qkv.view(1, 3, -1), rope.cos, rope.sin, rope.positions, k_cache, v_cache, 4, 2,
                          backend="reference")
    assert torch.equal(q, want) and torch.equal(rope.k_cache, k_cache) and torch.equal(rope.v_cache, v_cache)


@needs_sm90
@pytest.mark.parametrize("heads, kv_heads, D, K, ring_kb", [(12, 2, 128, 1536, 48), (12, 2, 128, 1536, 96),
                                                            (4, 2, 16, 64, 8)])
@pytest.mark.parametrize("T", [1, 5, 17])
@pytest.mark.parametrize("settled", [False, True], ids=["late", "early"])
def test_rope_fused_equals_the_plain_projection_then_rope_cache(settled, T, heads, kv_heads, D, K, ring_kb):
    """Bit for bit: the fused epilogue rounds and rotates as kernels.rope_cache does after this
    kernel's plain projection, so the engine's fused and two-launch routes agree; the tables read
    before the wait (settled) or after it."""
    from batchd.kernels.rope_cache import rope_and_store

    x, w, kwargs, rope = _rope_case(T, heads, kv_heads, D, K, "cuda", seed=T)
    q = stream_linear(x, w, **kwargs, rope=rope, ring_bytes=ring_kb << 10, settled=settled)
    qkv = stream_linear(x, w, **kwargs, ring_bytes=ring_kb << 10)
    k_cache, v_cache = torch.zeros_like(rope.k_cache), torch.zeros_like(rope.v_cache)
    want = rope_and_store(qkv.view(1, T, -1), rope.cos, rope.sin, rope.positions, k_cache, v_cache, heads, kv_heads)
    assert torch.equal(q, want)
    assert torch.equal(rope.k_cache, k_cache) and torch.equal(rope.v_cache, v_cache)
    assert rope.k_cache[0, :, 40:40 + T].abs().sum() > 0 and rope.k_cache[0, :, :40].abs().sum() == 0
    ref = stream_linear(x, w, **kwargs, rope=rope._replace(k_cache=torch.zeros_like(k_cache),
                                                          v_cache=torch.zeros_like(v_cache)), backend="reference")
    assert rel_err(q, ref) < 2 * REL_ERR[torch.bfloat16]


@needs_sm90
def test_rope_verify_rows_equal_decode_steps_bit_for_bit():
    """A verify step of 17 tokens writes the q rows and cache rows that 17 one-token steps write."""
    x, w, kwargs, rope = _rope_case(17, 12, 2, 128, 1536, "cuda", seed=3)
    q = stream_linear(x, w, **kwargs, rope=rope, ring_bytes=48 << 10)
    k_cache, v_cache = torch.zeros_like(rope.k_cache), torch.zeros_like(rope.v_cache)
    for t in range(17):
        one = rope._replace(cos=rope.cos[t:t + 1], sin=rope.sin[t:t + 1], positions=rope.positions[t:t + 1],
                            k_cache=k_cache, v_cache=v_cache)
        q_t = stream_linear(x[t:t + 1], w, bias=kwargs["bias"], row_sumsq=kwargs["row_sumsq"][:, t:t + 1].contiguous(),
                            rope=one, ring_bytes=48 << 10)
        assert torch.equal(q_t[:, :, 0], q[:, :, t])
    assert torch.equal(k_cache, rope.k_cache) and torch.equal(v_cache, rope.v_cache)


def test_timeline_unpacks_the_phase_marks_per_stream_launch():
    """bench/timeline.py's phase_table reads stream_phase_marks' packed slot: 16 bits a phase,
    medians over the middle layers, one kernel's launches at a time, CTAs without marks left out."""
    from types import SimpleNamespace

    from bench.timeline import phase_table

    def packed(*ns):   # the kernel's long long: phases at 48 bits and up read as negative
        bits = sum(v << (16 * i) for i, v in enumerate(ns))
        return bits - (1 << 64) if bits >= 1 << 63 else bits

    step = []
    for layer in range(4):
        step.append((SimpleNamespace(label="stream 1024x1536 rope"),
                     torch.tensor([[0, 100, 4100, packed(1000, 1500, 3000, 3400)],
                                   [0, 100, 4300, packed(1200, 1700, 2800, 3600)],
                                   [0, 100, 900, packed(65535, 65535, 65535, 65535)]], dtype=torch.int64)))
        step.append((SimpleNamespace(label="attention cluster x16"),
                     torch.tensor([[0, 200, 2200, packed(500, 900, 1400, 1800)]], dtype=torch.int64)))
        step.append((SimpleNamespace(label="attention split x18"), torch.zeros(2, 4, dtype=torch.int64)))
    (row,) = phase_table(step, num_layers=4, kernel="stream")
    assert row["launch"] == "stream 1024x1536 rope" and row["ctas"] == 4
    assert (row["x_staged"], row["weights_there"], row["dot_done"], row["epilogue_issued"], row["end"]) == \
        (1.1, 1.6, 2.9, 3.5, 4.1)
    (row,) = phase_table(step, num_layers=4, kernel="attention cluster")
    assert (row["kv_staged"], row["partials_pushed"], row["partials_landed"], row["merged"], row["end"]) == \
        (0.5, 0.9, 1.4, 1.8, 2.0)
