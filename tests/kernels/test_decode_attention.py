"""decode_attention: the Triton kernel against the reference, the reference against its definition."""
from __future__ import annotations

import math

import pytest
import torch

from batchd.kernels import decode_attention
from batchd.kernels.decode_attention import decode_attention_reference
from tests.kernels.conftest import DEVICE, REL_ERR, needs_triton, rel_err


def make(B, Hq, Hkv, QR, D, S_max, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, QR, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S_max, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S_max, D, generator=g).to(dtype)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)


def naive_attention(q, k, v, lengths):
    """Per sequence, head and lane: softmax over rows 0..len-Q+i, in float64, one loop at a time."""
    B, Hq, QR, D = q.shape
    G = Hq // k.shape[1]
    out = torch.zeros(B, Hq, QR, D, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            for i in range(QR):
                last = lengths[b] - QR + i
                keys, values = k[b, h // G, : last + 1].double(), v[b, h // G, : last + 1].double()
                probs = torch.softmax(keys @ q[b, h, i].double() / math.sqrt(D), dim=0)
                out[b, h, i] = probs @ values
    return out


def test_reference_matches_per_lane_definition():
    q, k, v = make(2, 6, 2, 3, 16, 40, torch.float32)
    lengths = [40, 9]
    ref = decode_attention_reference(q.cpu(), k.cpu(), v.cpu(), torch.tensor(lengths), compute_dtype=torch.float64)
    assert rel_err(ref, naive_attention(q.cpu(), k.cpu(), v.cpu(), lengths)) < 1e-6   # ref is rounded to float32


# (B, Hq, Hkv, Q, D, S_max, lengths): Q = 1..16, GQA groups 1/3/4/8, lengths inside and exactly at
# 64-row block edges (the kernel's key tile), different lengths per sequence
CASES = [
    pytest.param(2, 4, 4, 1, 32, 160, [128, 64], id="q1-g1-edges"),
    pytest.param(1, 6, 2, 2, 32, 200, [130], id="q2-g3-inside"),
    pytest.param(2, 8, 2, 4, 64, 192, [192, 70], id="q4-g4-full-and-inside"),
    pytest.param(1, 16, 2, 5, 32, 128, [65], id="q5-g8-one-past-edge"),
    pytest.param(2, 3, 1, 8, 32, 256, [200, 8], id="q8-g3-len-equals-q"),
    pytest.param(1, 2, 2, 16, 64, 160, [143], id="q16-g1"),
    pytest.param(1, 8, 1, 16, 32, 64, [64], id="q16-g8-one-block"),
]


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("B, Hq, Hkv, QR, D, S_max, lengths", CASES)
def test_triton_matches_reference(B, Hq, Hkv, QR, D, S_max, lengths, dtype):
    q, k, v = make(B, Hq, Hkv, QR, D, S_max, dtype)
    seq_len = torch.tensor(lengths, device=DEVICE)
    out = decode_attention(q, k, v, seq_len, backend="triton")
    ref = decode_attention_reference(q, k, v, seq_len, compute_dtype=torch.float64)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, ref) < REL_ERR[dtype]


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_rows_past_seq_len_are_never_read(backend):
    q, k, v = make(2, 4, 2, 3, 32, 160, torch.bfloat16)
    seq_len = torch.tensor([100, 37], device=DEVICE)
    clean = decode_attention(q, k, v, seq_len, backend=backend)
    k[0, :, 100:], v[0, :, 100:] = float("nan"), float("nan")
    k[1, :, 37:], v[1, :, 37:] = float("nan"), float("inf")
    assert torch.equal(decode_attention(q, k, v, seq_len, backend=backend), clean)


@needs_triton
@pytest.mark.triton
def test_int_seq_len_equals_tensor_seq_len():
    q, k, v = make(2, 4, 1, 2, 32, 96, torch.float16)
    a = decode_attention(q, k, v, 90, backend="triton")
    b = decode_attention(q, k, v, torch.tensor([90, 90], device=DEVICE), backend="triton")
    assert torch.equal(a, b)


def test_reference_backend_is_float32_accurate():
    q, k, v = make(1, 8, 2, 4, 32, 300, torch.bfloat16)
    out = decode_attention(q, k, v, 257, backend="reference")
    ref = decode_attention_reference(q, k, v, torch.tensor([257], device=DEVICE), compute_dtype=torch.float64)
    assert rel_err(out, ref) < REL_ERR[torch.bfloat16]


@pytest.mark.parametrize("change, message", [
    (dict(Hq=6, Hkv=4), "multiple of KV heads"),
    (dict(QR=17), "1..16 query rows per sequence, got 17"),
    (dict(v_dtype=torch.float16), "share one dtype"),
    (dict(seq_len=2), r"seq_len \(2\) must count the 4 new rows"),
    (dict(seq_len=97), "seq_len must be in 1..96"),
])
def test_bad_inputs_name_the_numbers(change, message):
    shape = dict(Hq=8, Hkv=2, QR=4) | {k: v for k, v in change.items() if k in ("Hq", "Hkv", "QR")}
    q, k, v = make(1, shape["Hq"], shape["Hkv"], shape["QR"], 16, 96, torch.bfloat16)
    v = v.to(change.get("v_dtype", v.dtype))
    with pytest.raises(ValueError, match=message):
        decode_attention(q, k, v, change.get("seq_len", 50), backend="reference")


def test_unknown_backend_is_refused():
    q, k, v = make(1, 2, 2, 1, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="backend must be one of"):
        decode_attention(q, k, v, 8, backend="cuda")


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("QR, Hq", [(5, 6), (5, 12), (16, 12), (11, 14)], ids=["G3-Q5", "G6-Q5", "G6-Q16", "G7-Q11"])
def test_verify_lane_equals_decode_step_bitwise(dtype, QR, Hq):
    """Lane i of a Q-row verify step must equal the one-row decode step at the same position, bit
    for bit: greedy output may not change when speculation is switched on (split boundaries sit
    at fixed cache rows; the tile is G * 16 rows for every Q, or for G = 6 and 7 fitted to G * Q rows
    of at least 64: a 64-row decode tile against a 64- or 128-row verify tile)."""
    S_max, seq_len = 640, 514  # lanes around a length where seq_len-derived splits would change
    q, k, v = make(1, Hq, 2, QR, 32, S_max, dtype, seed=3)
    verify = decode_attention(q, k, v, torch.tensor([seq_len], device=DEVICE), backend="triton")
    for i in range(QR):
        lane_len = seq_len - QR + 1 + i
        decode = decode_attention(q[:, :, i : i + 1].contiguous(), k, v, torch.tensor([lane_len], device=DEVICE),
                                  backend="triton")
        assert torch.equal(verify[:, :, i : i + 1], decode), f"lane {i} differs from its decode step"


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("QR, lengths", [(1, [70, 33]), (5, [70, 33]), (3, [64, 9])])
def test_settled_rows_read_early_change_no_bits(QR, lengths, use_options):
    """settled=True reads seq_len and each split's first block of older rows before the wait and
    only the QR new rows after it (new rows inside and across a block edge, splits of one and of
    several blocks): the same bits as settled=False and as early_reads="off"."""
    from batchd.kernels.decode_attention.triton_kernel import decode_attention_triton

    q, k, v = make(2, 4, 2, QR, 32, 96, torch.bfloat16, seed=4)
    seq_len = torch.tensor(lengths, device=DEVICE)
    for splits in (3, 12):   # 32 rows per split (two 16-row blocks) and 8 (one 16-row block, some empty)
        early = decode_attention_triton(q, k, v, seq_len, 0.2, num_splits=splits, block_n=16, settled=True)
        assert torch.equal(early, decode_attention_triton(q, k, v, seq_len, 0.2, num_splits=splits, block_n=16))
        use_options(early_reads="off")
        assert torch.equal(early, decode_attention_triton(q, k, v, seq_len, 0.2, num_splits=splits, block_n=16,
                                                          settled=True))
        use_options(early_reads="auto")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@needs_triton
@pytest.mark.parametrize("QR", [1, 8])
def test_cuda_settled_rows_change_no_bits_at_qwen_shape(QR, use_options):
    """Qwen2.5-1.5B's layout (12 query heads on 2 KV heads, D = 128) and its tuned tile, a cache of
    784 rows (25 splits of one block), calls finished one by one: the same bits with the settled
    rows read before the wait as after it. (bench/step_sweep.py "table;early_reads="off"" checks
    the same on whole graph-replayed decode runs, where the kernels do overlap.)"""
    q, k, v = make(1, 12, 2, QR, 128, 784, torch.bfloat16, seed=5)
    for length in (512, 544, 545, 600, 783):         # new rows at, after and inside split edges
        seq_len = torch.tensor([length], device=DEVICE)
        use_options(early_reads="auto")
        early = decode_attention(q, k, v, seq_len, settled=True)
        torch.cuda.synchronize()
        use_options(early_reads="off")
        assert torch.equal(early, decode_attention(q, k, v, seq_len, settled=True)), f"seq_len {length}"


def test_default_splits_stop_at_max_splits(monkeypatch):
    """default_num_splits: four programs per multiprocessor, no more splits than key blocks, and
    never more than MAX_SPLITS (what bench/step_sweep.py attn_splits=N sets)."""
    from batchd.kernels.decode_attention import triton_kernel

    cpu = torch.device("cpu")                      # counts as 4 multiprocessors
    assert triton_kernel.MAX_SPLITS == 132
    assert triton_kernel.default_num_splits(1, 32768, 32, cpu) == 16
    assert triton_kernel.default_num_splits(1, 96, 32, cpu) == 3
    monkeypatch.setattr(triton_kernel, "MAX_SPLITS", 5)
    assert triton_kernel.default_num_splits(1, 32768, 32, cpu) == 5


@needs_triton
@pytest.mark.parametrize("columns", [0, 16, 32, 64])
def test_merge_columns_split_changes_no_bits(columns, monkeypatch):
    """The merge's programs may take a head's output columns in slices (MERGE_COLUMNS): each
    column's weights and sums are the same arithmetic, so the output is the same bits whatever the
    slice (D = 64 and 48, the latter not a multiple of the slice)."""
    from batchd.kernels.decode_attention import triton_kernel

    for D in (64, 48):
        g = torch.Generator().manual_seed(D)
        o_part = torch.randn(1, 4, 2, 6, D, generator=g).to(DEVICE)
        l_part = torch.randn(1, 4, 2, 6, generator=g).to(DEVICE)
        l_part[0, 1, 0, 3:] = float("-inf")            # splits a row never saw
        seq_len = torch.tensor([6 * 32], device=DEVICE)
        outs = []
        for cols in (0, columns):
            monkeypatch.setattr(triton_kernel, "MERGE_COLUMNS", cols)
            out = torch.empty(1, 4, 2, D, device=DEVICE)
            outs.append(triton_kernel.merge_splits(o_part, l_part, out, seq_len, block_n=32, splits_from_seq_len=True,
                                                   s_max=6 * 32))
        w = torch.exp2(l_part - l_part.amax(-1, keepdim=True))
        ref = (w[..., None] * o_part).sum(-2) / w.sum(-1)[..., None]
        assert torch.allclose(outs[0], ref, atol=1e-5)
        assert torch.equal(outs[0], outs[1]), f"D {D}: {columns} columns a program"
