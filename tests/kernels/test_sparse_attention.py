"""Sparse attention: summaries, Quest scoring, per-lane selection, attention over the lanes' union of
blocks (each lane bitwise equal to its own decode step), the dense/sparse rule."""
from __future__ import annotations

import math

import pytest
import torch

from batchd.kernels import BlockKeySummary, decode_attention, sparse_decode_attention, sparse_is_worthwhile
from batchd.kernels.sparse_attention import (
    block_scores_reference,
    keep_all_rows,
    select_blocks,
    select_from_scores,
    selection_visibility,
    sparse_attention,
    sparse_attention_reference,
)
from batchd.kernels.decode_attention import decode_attention_reference
from tests.kernels.conftest import DEVICE, REL_ERR, needs_triton, rel_err

BS = 16          # small blocks keep interpreter runs short; the kernels take any power of two >= 16


def make(B, Hq, Hkv, QR, D, S_max, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, QR, D, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(B, Hkv, S_max, D, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(B, Hkv, S_max, D, generator=g).to(dtype).to(DEVICE)
    return q, k, v


def full_summary(k, length, block_size=BS):
    summary = BlockKeySummary.for_cache(k, block_size=block_size)
    summary.update(k, 0, length, backend="reference")
    return summary


BACKENDS = ["reference", pytest.param("triton", marks=[needs_triton, pytest.mark.triton])]


@pytest.mark.parametrize("backend", BACKENDS)
def test_incremental_updates_match_a_fresh_summary(backend):
    _, k, _ = make(2, 2, 2, 1, 8, 200, torch.bfloat16)
    grown = BlockKeySummary.for_cache(k, block_size=BS)
    length = 0
    for step in (1, 5, 10, 16, 37, 1, 1, 64, 3):           # partial blocks, exact edges, several blocks
        grown.update(k, length, length + step, backend=backend)
        length += step
        fresh = full_summary(k, length)
        n = -(-length // BS)
        assert torch.equal(grown.kmin[:, :, :n], fresh.kmin[:, :, :n])
        assert torch.equal(grown.kmax[:, :, :n], fresh.kmax[:, :, :n])
    assert grown.length == length == 138


@pytest.mark.parametrize("backend", BACKENDS)
def test_rollback_then_rewrite_matches_a_fresh_summary(backend):
    _, k, _ = make(1, 2, 2, 1, 8, 128, torch.float16)
    summary = full_summary(k, 90)
    k[:, :, 70:90] = torch.randn(1, 2, 20, 8, dtype=k.dtype, device=DEVICE) * 5    # rejected drafts rewritten
    summary.update(k, 70, 90, backend=backend)
    fresh = full_summary(k, 90)
    assert torch.equal(summary.kmin[:, :, :6], fresh.kmin[:, :, :6])
    assert torch.equal(summary.kmax[:, :, :6], fresh.kmax[:, :, :6])


@pytest.mark.parametrize("backend", BACKENDS)
def test_device_length_updates_match_a_fresh_summary(backend):
    """update_on_device (the CUDA-graph form: start read on the device) equals a fresh summary."""
    _, k, _ = make(1, 2, 2, 1, 8, 160, torch.bfloat16, seed=4)
    summary = BlockKeySummary.for_cache(k, block_size=BS)
    length = 0
    for rows in (9, 1, 7, 16, 5, 17, 1):                   # within a block, at an edge, straddling one
        summary.update_on_device(k, torch.tensor([length], device=DEVICE), rows, backend=backend)
        length += rows
        fresh = full_summary(k, length)
        n = -(-length // BS)
        assert torch.equal(summary.kmin[:, :, :n], fresh.kmin[:, :, :n])
        assert torch.equal(summary.kmax[:, :, :n], fresh.kmax[:, :, :n])


def test_bound_is_never_below_a_visible_score():
    q, k, _ = make(1, 4, 2, 3, 16, 96, torch.float32)
    seq_len = torch.tensor([90], device=DEVICE)
    summary = full_summary(k, 90)
    scores = block_scores_reference(q, summary.kmin, summary.kmax, seq_len, BS, recent_blocks=1,
                                    compute_dtype=torch.float64)
    dots = torch.einsum("bhgqd,bhsd->bhgqs", q.double().reshape(1, 2, 2, 3, 16), k.double())
    per_block = dots[..., :96].unflatten(-1, (6, BS)).amax(-1).amax(2)           # [B, Hkv, Q, NB]
    finite = scores.isfinite()
    assert (scores[finite] >= per_block[finite] - 1e-9).all()


def forced_blocks_hold(selected, seq_len, QR, recent):
    for b in range(selected.shape[0]):
        for i in range(QR):
            last = (int(seq_len[b]) - QR + i) // BS
            want = {0} | set(range(max(0, last - recent + 1), last + 1))
            for h in range(selected.shape[1]):
                if not want <= set(selected[b, h, i].nonzero().flatten().tolist()):
                    return False
    return True


@pytest.mark.parametrize("backend", BACKENDS)
def test_sink_and_recent_blocks_always_selected(backend):
    # 5 lanes whose last rows straddle a block edge, budget = sink + 2 recent: nothing else fits
    q, k, _ = make(2, 6, 2, 5, 16, 160, torch.bfloat16)
    seq_len = torch.tensor([147, 98], device=DEVICE)
    summary = full_summary(k, 147)
    selected = select_blocks(q, summary, seq_len, top_k=3, recent_blocks=2, backend=backend)
    assert selected.shape == (2, 2, 5, 10) and selected.dtype == torch.bool
    assert forced_blocks_hold(selected.cpu(), seq_len.cpu(), 5, recent=2)


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("B, Hq, Hkv, QR, S_max, lengths", [
    pytest.param(1, 4, 4, 1, 256, [256], id="q1-g1-edge"),
    pytest.param(2, 6, 2, 4, 240, [231, 120], id="q4-g3"),
    pytest.param(1, 8, 1, 16, 192, [185], id="q16-g8"),
])
def test_triton_scores_match_reference(B, Hq, Hkv, QR, S_max, lengths, dtype):
    q, k, _ = make(B, Hq, Hkv, QR, 32, S_max, dtype)
    seq_len = torch.tensor(lengths, device=DEVICE)
    summary = full_summary(k, max(lengths))
    from batchd.kernels.sparse_attention.triton_kernel import block_scores_triton

    got = block_scores_triton(q, summary.kmin, summary.kmax, seq_len, BS, 2)
    want = block_scores_reference(q, summary.kmin, summary.kmax, seq_len, BS, 2, compute_dtype=torch.float64)
    finite = want.isfinite()
    assert torch.equal(finite, got.isfinite()) and torch.equal(got[~finite], want[~finite].float())
    assert rel_err(got[finite], want[finite]) < 1e-5


def test_selection_keeps_top_k_with_lowest_ids_on_ties_and_only_visible_blocks():
    inf = float("inf")
    scores = torch.tensor([[[[inf, 1.0, 3.0, 3.0, 3.0, 2.0, -inf, -inf],       # ties at the cut: lowest ids
                             [inf, -inf, -inf, -inf, -inf, -inf, -inf, -inf],  # sees one block: keeps one
                             [0.5, -1.0, 0.25, -2.0, 7.0, inf, inf, -inf]]]])
    seq_len = torch.tensor([10_000])                                          # no lane keeps everything
    want = torch.tensor([[[[1, 0, 1, 1, 0, 0, 0, 0],
                           [1, 0, 0, 0, 0, 0, 0, 0],
                           [0, 0, 0, 0, 1, 1, 1, 0]]]], dtype=torch.bool)
    assert torch.equal(select_from_scores(scores, 3, seq_len, keep_all_rows=100), want)


@needs_triton
@pytest.mark.triton
def test_triton_selection_equals_reference_selection():
    """Same blocks as the stable-sort reference, ties and infinities included, for every lane."""
    g = torch.Generator().manual_seed(7)
    B, Hkv, QR, NB = 2, 2, 6, 37
    scores = torch.randint(-4, 5, (B, Hkv, QR, NB), generator=g).float() / 4       # many ties
    scores[..., 0] = float("inf")
    scores[..., 30:] = float("-inf")
    scores[0, 1, 2, :] = float("-inf")
    scores[1, 0, 3, 5:] = float("-inf")                                            # fewer visible than top_k
    seq_len = torch.tensor([2000, 1_000_000])
    from batchd.kernels.sparse_attention.triton_kernel import select_from_scores_triton

    for top_k in (1, 7, 30, NB):
        got = select_from_scores_triton(scores.to(DEVICE), seq_len.to(DEVICE), top_k, 2000 - 3).cpu()
        assert torch.equal(got, select_from_scores(scores, top_k, seq_len, 2000 - 3)), f"top_k={top_k}"


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("B, Hq, Hkv, QR, S_max, lengths, top_k", [
    pytest.param(2, 4, 1, 1, 320, [320, 200], 5, id="q1-g4-edge"),
    pytest.param(1, 6, 2, 3, 300, [290], 4, id="q3-g3"),
    pytest.param(2, 3, 3, 8, 256, [250, 97], 6, id="q8-g1"),
    pytest.param(1, 8, 1, 16, 224, [224], 5, id="q16-g8-edge"),
])
def test_sparse_kernel_attends_exactly_the_selected_blocks(B, Hq, Hkv, QR, S_max, lengths, top_k, dtype):
    q, k, v = make(B, Hq, Hkv, QR, 32, S_max, dtype)
    seq_len = torch.tensor(lengths, device=DEVICE)
    summary = full_summary(k, max(lengths))
    selected = select_blocks(q, summary, seq_len, top_k=top_k, backend="triton")
    assert torch.equal(selected, select_blocks(q, summary, seq_len, top_k=top_k, backend="reference"))
    out = sparse_attention(q, k, v, seq_len, selected, block_size=BS, backend="triton")
    ref = sparse_attention_reference(q, k, v, seq_len, selected, BS, 1 / math.sqrt(32), torch.float64)
    assert rel_err(out, ref) < REL_ERR[dtype]
    # lanes that see more than twice the budget really attend to fewer rows than dense attention
    visible = selection_visibility(selected, seq_len, QR, BS, max(lengths))
    sparse_lanes = (seq_len[:, None] - QR + 1 + torch.arange(QR, device=DEVICE)) > keep_all_rows(top_k, BS)
    assert sparse_lanes.any()
    assert (visible.sum(-1)[sparse_lanes[:, None].expand(-1, Hkv, -1)] <= top_k * BS).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_visible_block_selected_equals_dense_for_every_lane(backend):
    # batched lanes at different lengths: a budget that covers everything must drop no visible row
    q, k, v = make(2, 4, 2, 6, 16, 128, torch.float32)
    seq_len = torch.tensor([128, 53], device=DEVICE)
    summary = full_summary(k, 128)
    selected = select_blocks(q, summary, seq_len, top_k=8, backend=backend)
    out = sparse_attention(q, k, v, seq_len, selected, block_size=BS, backend=backend)
    dense = decode_attention_reference(q, k, v, seq_len, compute_dtype=torch.float64)
    assert rel_err(out, dense) < 1e-5


def lanes_and_solo_steps(q16, k, v, lengths, summary, top_k, widths):
    """Run the Q-row sparse step for each Q in `widths` and the 16 one-row decode steps that its lanes
    stand for (q16[:, :, t] is the query of position lengths - 16 + t); yield (Q, lane, step, solo).
    Outputs in float32, so that any difference in the partial sums shows (a bf16/f16 output's rounding
    would hide most)."""
    from batchd.kernels.sparse_attention.triton_kernel import sparse_attention_triton

    def run(q, sl):
        chosen = select_blocks(q, summary, sl, top_k=top_k, backend="triton")
        return sparse_attention_triton(q, k, v, sl, chosen, summary.block_size, q.shape[-1] ** -0.5,
                                       out_dtype=torch.float32)

    seq_len = torch.tensor(lengths, device=DEVICE)
    solo = [run(q16[:, :, t:t + 1].contiguous(), seq_len - 15 + t) for t in range(16)]
    for QR in widths:
        step = run(q16[:, :, 16 - QR:].contiguous(), seq_len)
        for i in range(QR):
            yield QR, i, step[:, :, i:i + 1], solo[16 - QR + i]


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype, B, Hq, Hkv, S_max, lengths, top_k, widths", [
    pytest.param(torch.bfloat16, 1, 2, 1, 208, [200], 4, range(1, 17), id="bf16-g2-inside-q1..16"),
    pytest.param(torch.float16, 1, 6, 2, 192, [192], 3, (5, 16), id="f16-g3-edge"),
    pytest.param(torch.float32, 2, 2, 2, 192, [192, 139], 4, (8,), id="f32-g1-two-lengths"),
    pytest.param(torch.float16, 1, 8, 1, 240, [225], 4, (3, 16), id="f16-g8-inside"),
])
def test_verify_lane_equals_its_decode_step_bitwise(dtype, B, Hq, Hkv, S_max, lengths, top_k, widths):
    """Lane i of a Q-row sparse step equals the one-row step at its position bit for bit, although the
    step reads the union of all lanes' blocks: greedy output may not change with speculation on."""
    q16, k, v = make(B, Hq, Hkv, 16, 16, S_max, dtype, seed=11)
    summary = full_summary(k, max(lengths))
    for QR, i, step, solo in lanes_and_solo_steps(q16, k, v, lengths, summary, top_k, widths):
        assert torch.equal(step, solo), f"Q={QR} lane {i} differs from its decode step"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_reference_lane_equals_its_decode_step_bitwise(dtype):
    """The PyTorch twin (the engine's path on the CPU) keeps the property too: scoring is elementwise
    per lane, selection exact, attention lane by lane over the lane's own rows."""
    q16, k, v = make(1, 6, 2, 16, 16, 256, dtype, seed=13)
    summary = full_summary(k, 250)
    seq_len = torch.tensor([250], device=DEVICE)

    def run(q, sl):
        chosen = select_blocks(q, summary, sl, top_k=4, backend="reference")
        return sparse_attention(q, k, v, sl, chosen, block_size=BS, backend="reference")

    solo = [run(q16[:, :, t:t + 1], seq_len - 15 + t) for t in range(16)]
    for QR in (2, 7, 16):
        step = run(q16[:, :, 16 - QR:], seq_len)
        for i in range(QR):
            assert torch.equal(step[:, :, i:i + 1], solo[16 - QR + i]), f"Q={QR} lane {i}"


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_lanes_across_the_rule_equal_their_decode_steps_bitwise(dtype):
    """A verify step whose first lanes see at most 2 * top_k blocks' rows (they keep every block) and
    whose last lanes see more (top_k blocks): every lane equals its decode step through the public
    entry, where the first lanes' decode steps run the dense kernel (same 64-row blocks)."""
    top_k, QR, length = 3, 6, 387               # keep_all_rows = 384: lanes see 382..387 rows
    q, k, v = make(1, 4, 1, QR, 16, 448, dtype, seed=5)
    summary = full_summary(k, length, block_size=64)
    step = sparse_decode_attention(q, k, v, length, summary, top_k=top_k, backend="triton")
    for i in range(QR):
        lane_len = length - QR + 1 + i
        assert sparse_is_worthwhile(lane_len, 1, top_k, 64) == (lane_len > 384)
        solo = sparse_decode_attention(q[:, :, i:i + 1].contiguous(), k, v, lane_len, summary, top_k=top_k,
                                       backend="triton")
        assert torch.equal(step[:, :, i:i + 1], solo), f"lane {i} ({lane_len} rows) differs from its decode step"


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["f16", "f32"])
def test_every_block_kept_equals_the_dense_kernel_bitwise(dtype):
    """With all visible blocks kept, the sparse kernel does the dense kernel's arithmetic, block for block."""
    q, k, v = make(2, 8, 2, 5, 32, 448, dtype, seed=2)
    seq_len = torch.tensor([448, 301], device=DEVICE)
    n_blocks = 7
    everything = torch.ones(2, 2, 5, n_blocks, dtype=torch.bool, device=DEVICE)
    visible_blocks = torch.arange(n_blocks, device=DEVICE) * 64 < seq_len[:, None, None, None]
    out = sparse_attention(q, k, v, seq_len, everything & visible_blocks, block_size=64, backend="triton")
    assert torch.equal(out, decode_attention(q, k, v, seq_len, backend="triton"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rule_says_dense_result_is_dense_exactly(backend):
    q, k, v = make(1, 4, 2, 4, 16, 192, torch.bfloat16)
    summary = full_summary(k, 150)
    assert not sparse_is_worthwhile(150, 4, top_k=5, block_size=BS)       # 160 rows would be kept
    out = sparse_decode_attention(q, k, v, 150, summary, top_k=5, backend=backend)
    assert torch.equal(out, decode_attention(q, k, v, 150, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rule_says_sparse_result_is_the_selected_blocks(backend):
    q, k, v = make(1, 4, 2, 2, 16, 192, torch.bfloat16)
    summary = full_summary(k, 180)
    assert sparse_is_worthwhile(180, 2, top_k=4, block_size=BS)           # 64 kept of 179 visible
    seq_len = torch.tensor([180], device=DEVICE)
    out = sparse_decode_attention(q, k, v, 180, summary, top_k=4, backend=backend)
    selected = select_blocks(q, summary, seq_len, top_k=4, backend=backend)
    ref = sparse_attention_reference(q, k, v, seq_len, selected, BS, 0.25, torch.float64)
    assert rel_err(out, ref) < REL_ERR[torch.bfloat16]
    assert rel_err(out, decode_attention_reference(q, k, v, seq_len)) > 1e-3       # it did drop rows


@pytest.mark.parametrize("min_seq_len, q_rows, top_k, block_size, sparse", [
    (8193, 1, 64, 64, True),       # 8193 visible, 4096 kept: removes more than half
    (8192, 1, 64, 64, False),      # 8192 visible, 4096 kept: exactly half is not enough
    (8193, 8, 64, 64, True),       # the last lane decides; the first lanes keep all their rows
    (8192, 8, 64, 64, False),
])
def test_sparse_only_when_more_than_half_removed(min_seq_len, q_rows, top_k, block_size, sparse):
    assert sparse_is_worthwhile(min_seq_len, q_rows, top_k, block_size) is sparse


def test_stale_summary_and_bad_budget_are_refused():
    q, k, v = make(1, 4, 2, 1, 16, 256, torch.float32)
    summary = full_summary(k, 100)
    with pytest.raises(ValueError, match="summary covers 100 rows but seq_len is 200"):
        sparse_decode_attention(q, k, v, 200, summary, top_k=3, backend="reference")
    with pytest.raises(ValueError, match=r"top_k must be in 3..16 .* got 2"):
        sparse_decode_attention(q, k, v, 100, summary, top_k=2, backend="reference")


def compile_sparse_kernels_for_hopper():
    """Compile (not run) the sparse kernels for sm_90; needs TRITON_INTERPRET unset, no GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from batchd.kernels.sparse_attention import triton_kernel as tk

    def compile_for_h200(fn, signature, constants, num_warps):
        signature = {**signature, **{name: "constexpr" for name in constants}}
        source = ASTSource(fn=fn, signature=signature, constexprs=constants)
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})

    i32 = lambda *names: {name: "i32" for name in names}  # noqa: E731
    compile_for_h200(
        tk._block_scores_kernel,
        {"Q": "*bf16", "KMin": "*bf16", "KMax": "*bf16", "SeqLen": "*i64", "Scores": "*fp32",
         **i32("stride_qb", "stride_qh", "stride_qq", "stride_sb", "stride_sh", "stride_sn", "H_KV", "N_BLOCKS")},
        {"Q_ROWS": 8, "GROUP": 4, "HEAD_DIM": 128, "BLOCK_SIZE": 64, "RECENT": 2, "G_P2": 4, "LANES": 16,
         "BLOCK_B": 64, "BLOCK_D": 128, "D_CHUNK": 128, "UPCAST_DOT": False, "DOT_PRECISION": "tf32", "USE_PDL": True},
        num_warps=4)
    compile_for_h200(
        tk._select_blocks_kernel,
        {"Scores": "*fp32", "SeqLen": "*i64", "Selected": "*u8", **i32("H_KV", "N_BLOCKS")},
        {"Q_ROWS": 8, "TOP_K": 64, "KEEP_ALL_ROWS": 8192, "NB_P2": 2048, "LANE_TILE": 1, "USE_PDL": True},
        num_warps=4)
    compile_for_h200(
        tk._sparse_split_kernel,
        {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "SeqLen": "*i64", "Selected": "*u8", "O_part": "*fp32",
         "L_part": "*fp32", "qk_scale": "fp32",
         **i32("stride_qb", "stride_qh", "stride_qq", "stride_kb", "stride_kh", "stride_kn", "stride_vb", "stride_vh",
               "stride_vn", "H_KV", "S_MAX", "N_BLOCKS")},
        {"Q_ROWS": 8, "GROUP": 4, "HEAD_DIM": 128, "NUM_SPLITS": 66, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 128,
         "SPLIT_BLOCKS": 32, "LANES": 16, "UPCAST_DOT": False, "DOT_PRECISION": "tf32", "USE_PDL": True},
        num_warps=4)


@needs_triton
def test_sparse_kernels_compile_for_hopper():
    """The interpreter does not type-check as the compiler does (a bf16 maximum promoted to float32
    once broke tl.dot only on the GPU): compile the kernels for the H200 here, in a process without
    TRITON_INTERPRET (this one has it set), no GPU needed."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = "from tests.kernels.test_sparse_attention import compile_sparse_kernels_for_hopper as c; c()"
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                          env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
