"""kernels.decode_attention's cluster kernel (one launch, splits merged in distributed shared
memory): its plan everywhere; on an sm_90+ GPU, against the reference, decode lanes against verify
lanes bit for bit, settled reads, rows past seq_len, CUDA graphs and the routing of backend "auto"."""
from __future__ import annotations

import ctypes

import pytest
import torch

from kernels import decode_attention
from kernels.decode_attention import cluster_kernel, decode_attention_reference
from kernels.stream_linear import cuda_supported
from tests.kernels.conftest import REL_ERR, rel_err

SM90 = torch.cuda.is_available() and cuda_supported(torch.device("cuda"))
needs_sm90 = pytest.mark.skipif(not SM90, reason="needs an sm_90+ GPU (thread-block clusters)")


def test_args_struct_matches_the_kernels_layout():
    # cluster_attention.cu's struct Args: 5 pointers, 12 strides, 6 ints and a float, the trace
    # pointer (aligned: 164 -> 168) and its row (180, padded to 184), the long form's two pointers
    assert cluster_kernel._Args.h_kv.offset == 5 * 8 + 12 * 8 and cluster_kernel._Args.qk_scale.offset == 160
    assert cluster_kernel._Args.trace.offset == 168 and cluster_kernel._Args.partials.offset == 184
    assert ctypes.sizeof(cluster_kernel._Args) == 200


@pytest.mark.parametrize("s_max, D, G, Q, cluster, keys", [
    (784, 128, 6, 1, 16, 64),      # Qwen2.5-1.5B at bench/decode.py's 512 + 256 + 16 rows
    (784, 128, 6, 16, 8, 128),     # the widest verify, 8 CTAs a head
    (2048, 128, 4, 1, 16, 128),    # Llama-3-8B's layout at the largest cache that fits
    (2048, 64, 3, 4, 16, 128),     # SmolLM2's layout
])
def test_plan_gives_each_cta_a_whole_number_of_key_blocks(s_max, D, G, Q, cluster, keys):
    p = cluster_kernel.plan(s_max, D, G, Q, 2, cluster)
    assert p.keys_per_cta == keys and p.keys_per_cta * cluster >= s_max
    assert p.shared_mem <= cluster_kernel.MAX_SHARED_MEM


@pytest.mark.parametrize("s_max, D, G, heads, ctas, cluster, per_head, keys, ring", [
    (32768, 128, 6, 2, 132, 16, 4, 512, 4),     # Qwen2.5-1.5B at 32K on an H200: 128 CTAs of 512 rows
    (33088, 128, 6, 2, 132, 8, 8, 544, 4),      # bench/decode.py's 32K cache, clusters of 8
    (33088, 128, 4, 8, 132, 16, 1, 2080, 4),    # Llama-3-8B: one cluster a head already fills 128 SMs
    (2049, 128, 6, 2, 132, 16, 4, 64, 4),       # one row past the short form
    (32768, 128, 8, 2, 132, 8, 8, 512, 2),      # G = 8: only a 2-block ring leaves room for a 16-row verify
    (8192, 128, 6, 64, 132, 16, 1, 512, 4),     # many heads: one cluster each
])
def test_long_caches_take_the_long_form(s_max, D, G, heads, ctas, cluster, per_head, keys, ring):
    for q_rows in (1, 16):
        p = cluster_kernel.plan(s_max, D, G, q_rows, 2, cluster, heads=heads, long_ctas=ctas)
        assert (p.clusters_per_head, p.keys_per_cta, p.ring) == (per_head, keys, ring)
        assert p.keys_per_cta * per_head * cluster >= s_max and p.shared_mem <= cluster_kernel.MAX_SHARED_MEM


def test_long_form_refuses_what_its_ring_cannot_hold():
    # G = 8 and a 16-row verify: 128 rows, 32 parked tasks; with clusters of 16 nothing fits
    assert cluster_kernel.plan(32768, 128, 8, 1, 2, 16, heads=2, long_ctas=132) is None
    assert cluster_kernel.plan(32768, 128, 6, 1, 2, 16, heads=2, long_ctas=0) is None   # the long form off


@pytest.mark.parametrize("s_max, D, itemsize, cluster", [
    (32768, 128, 2, 16),   # a long cache without the long form: the split and merge kernels take it
    (2049, 128, 2, 16),    # one row past 16 CTAs of 128 keys
    (1025, 128, 2, 8),     # one row past 8 CTAs of 128 keys
    (784, 128, 4, 16),     # float32 caches
    (784, 80, 2, 16),      # D not a multiple of 32
    (784, 256, 2, 16),     # D past 128
    (784, 128, 2, 4),      # a cluster size the kernel is not built for
])
def test_plan_refuses_what_the_kernel_cannot_run(s_max, D, itemsize, cluster):
    assert cluster_kernel.plan(s_max, D, 6, 1, itemsize, cluster) is None


@pytest.mark.parametrize("D, G", [(64, 3), (128, 4), (128, 6), (64, 7), (128, 8)])
def test_whether_the_kernel_runs_never_depends_on_the_steps_width(D, G):
    """A decode step and a verify step over one cache must take the same kernel and split points
    (their lanes' bits would differ otherwise): plan's verdict may depend on the cache, never on q_rows."""
    for s_max in (*range(32, 4200, 97), 32768, 33088, 131072):
        for cluster in cluster_kernel.CLUSTER_SIZES:
            for heads, ctas in ((1, 0), (2, 132), (16, 132)):
                verdicts = set()
                for q_rows in range(1, 17):
                    p = cluster_kernel.plan(s_max, D, G, q_rows, 2, cluster, heads=heads, long_ctas=ctas)
                    verdicts.add(None if p is None else (p.keys_per_cta, p.clusters_per_head, p.ring))
                assert len(verdicts) == 1, f"S_max {s_max}, {cluster} CTAs, {heads} heads, {ctas} CTAs aimed at"


def test_cluster_switch_is_validated(monkeypatch):
    monkeypatch.setenv("BATCHD_ATTENTION_CLUSTER", "12")
    with pytest.raises(ValueError, match="0 \\(off\\) or one of"):
        cluster_kernel.cluster_size()
    monkeypatch.setenv("BATCHD_ATTENTION_CLUSTER", "0")
    assert cluster_kernel.cluster_size() == 0


def test_cluster_backend_off_sm90_says_what_to_use():
    if SM90:
        pytest.skip("this GPU runs the cluster kernel")
    q = torch.zeros(1, 4, 1, 32, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 64, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="use backend='auto' or 'triton'"):
        decode_attention(q, k, k.clone(), 10, backend="cluster")


def make(B, Hq, Hkv, QR, D, S_max, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, QR, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S_max, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S_max, D, generator=g).to(dtype)
    return q.cuda(), k.cuda(), v.cuda()


CASES = [   # (B, Hq, Hkv, QR, D, S_max, lengths)
    pytest.param(1, 12, 2, 1, 128, 784, [512], id="qwen1.5b-decode"),
    pytest.param(1, 12, 2, 5, 128, 784, [783], id="qwen1.5b-verify5-full"),
    pytest.param(1, 12, 2, 16, 128, 784, [17], id="qwen1.5b-verify16-short"),
    pytest.param(2, 32, 8, 3, 128, 1024, [1000, 70], id="llama8b-two-sequences"),
    pytest.param(2, 9, 3, 8, 64, 300, [300, 9], id="smollm2-full-and-len-near-q"),
    pytest.param(1, 14, 2, 11, 64, 1000, [640], id="g7-verify11"),
]


LAYOUTS = [("8", "32"), ("16", "32"), ("16", "64")]   # (CTAs a KV head, keys a softmax step)


@needs_sm90
@pytest.mark.parametrize("cluster, key_block", LAYOUTS, ids=["c8", "c16", "c16-kb64"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("B, Hq, Hkv, QR, D, S_max, lengths", CASES)
def test_cluster_kernel_matches_reference(B, Hq, Hkv, QR, D, S_max, lengths, dtype, cluster, key_block, monkeypatch):
    monkeypatch.setenv("BATCHD_ATTENTION_CLUSTER", cluster)
    monkeypatch.setenv("BATCHD_ATTENTION_KEY_BLOCK", key_block)
    q, k, v = make(B, Hq, Hkv, QR, D, S_max, dtype)
    seq_len = torch.tensor(lengths, device="cuda")
    out = decode_attention(q, k, v, seq_len, backend="cluster")
    ref = decode_attention_reference(q, k, v, seq_len, compute_dtype=torch.float64)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, ref) < REL_ERR[dtype]


@needs_sm90
@pytest.mark.parametrize("cluster, key_block", LAYOUTS, ids=["c8", "c16", "c16-kb64"])
@pytest.mark.parametrize("QR, Hq, D", [(5, 6, 64), (5, 12, 128), (16, 12, 128), (11, 14, 64)],
                         ids=["G3-Q5", "G6-Q5", "G6-Q16", "G7-Q11"])
def test_verify_lane_equals_decode_step_bitwise(QR, Hq, D, cluster, key_block, monkeypatch):
    """Lane i of a Q-row verify step equals the one-row decode step at its position, bit for bit
    (greedy output may not change with speculation): lengths around the edges of the CTAs' key
    ranges and of their 32-key blocks."""
    monkeypatch.setenv("BATCHD_ATTENTION_CLUSTER", cluster)
    monkeypatch.setenv("BATCHD_ATTENTION_KEY_BLOCK", key_block)
    q, k, v = make(1, Hq, 2, QR, D, 784, torch.bfloat16, seed=3)
    for seq_len in (QR, 64 + QR - 1, 514, 784):
        verify = decode_attention(q, k, v, torch.tensor([seq_len], device="cuda"), backend="cluster")
        for i in range(QR):
            decode = decode_attention(q[:, :, i : i + 1].contiguous(), k, v,
                                      torch.tensor([seq_len - QR + 1 + i], device="cuda"), backend="cluster")
            assert torch.equal(verify[:, :, i : i + 1], decode), f"seq_len {seq_len}: lane {i} differs"


@needs_sm90
@pytest.mark.parametrize("QR", [1, 8])
def test_settled_rows_read_early_change_no_bits(QR, monkeypatch):
    """settled=True stages the rows before the step's new ones before griddepcontrol.wait: the same
    bits as settled=False and as BATCHD_EARLY_READS=0, with new rows inside and across the CTAs'
    key ranges."""
    q, k, v = make(1, 12, 2, QR, 128, 784, torch.bfloat16, seed=5)
    for length in (QR, 64, 65, 70, 600, 783):
        seq_len = torch.tensor([length], device="cuda")
        early = decode_attention(q, k, v, seq_len, settled=True, backend="cluster")
        assert torch.equal(early, decode_attention(q, k, v, seq_len, backend="cluster")), f"seq_len {length}"
        monkeypatch.setenv("BATCHD_EARLY_READS", "0")
        assert torch.equal(early, decode_attention(q, k, v, seq_len, settled=True, backend="cluster"))
        monkeypatch.delenv("BATCHD_EARLY_READS")


@needs_sm90
def test_rows_past_seq_len_are_never_read():
    q, k, v = make(2, 12, 2, 3, 128, 784, torch.bfloat16)
    seq_len = torch.tensor([100, 37], device="cuda")
    clean = decode_attention(q, k, v, seq_len, backend="cluster")
    k[0, :, 100:], v[0, :, 100:] = float("nan"), float("nan")
    k[1, :, 37:], v[1, :, 37:] = float("nan"), float("inf")
    assert torch.equal(decode_attention(q, k, v, seq_len, backend="cluster"), clean)


@needs_sm90
def test_auto_takes_the_cluster_kernel_where_it_fits(monkeypatch):
    """backend "auto" gives the cluster kernel's bits on a short cache, and with the switch at 0 the
    Triton kernels' (equal within rounding, not bit for bit)."""
    q, k, v = make(1, 12, 2, 1, 128, 784, torch.bfloat16, seed=7)
    seq_len = torch.tensor([500], device="cuda")
    auto = decode_attention(q, k, v, seq_len)
    assert torch.equal(auto, decode_attention(q, k, v, seq_len, backend="cluster"))
    monkeypatch.setenv("BATCHD_ATTENTION_CLUSTER", "0")
    triton = decode_attention(q, k, v, seq_len)
    assert torch.equal(triton, decode_attention(q, k, v, seq_len, backend="triton"))
    assert rel_err(auto, triton) < REL_ERR[torch.bfloat16]


@needs_sm90
def test_cuda_graph_replay_follows_seq_len():
    q, k, v = make(1, 12, 2, 1, 128, 784, torch.bfloat16, seed=9)
    seq_len = torch.tensor([300], device="cuda")
    decode_attention(q, k, v, seq_len, backend="cluster")     # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, seq_len, backend="cluster")
    for length in (300, 301, 783):
        seq_len.fill_(length)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, decode_attention(q, k, v, seq_len, backend="cluster")), f"seq_len {length}"


LONG_LAYOUTS = [   # (CTAs a cluster, BATCHD_ATTENTION_LONG_CTAS, keys a softmax step)
    pytest.param("16", "", "32", id="c16-sms"),         # 132 SMs: 4 clusters a head at Hkv = 2
    pytest.param("8", "", "32", id="c8-sms"),
    pytest.param("16", "32", "32", id="c16-one-cluster"),   # one cluster a head: no cross-cluster merge
    pytest.param("16", "", "64", id="c16-kb64"),
]
LONG_CASES = [   # (B, Hq, Hkv, QR, D, S_max, lengths)
    pytest.param(1, 12, 2, 1, 128, 4200, [3000], id="qwen1.5b-decode"),
    pytest.param(1, 12, 2, 16, 128, 4200, [4200], id="qwen1.5b-verify16-full"),
    pytest.param(1, 12, 2, 5, 128, 4200, [40], id="qwen1.5b-verify5-short"),
    pytest.param(2, 32, 8, 3, 128, 2500, [2500, 70], id="llama8b-two-sequences"),
    pytest.param(2, 9, 3, 8, 64, 3000, [2999, 9], id="smollm2-full-and-len-near-q"),
    pytest.param(1, 14, 2, 11, 64, 5000, [4321], id="g7-verify11"),
]


@needs_sm90
@pytest.mark.parametrize("cluster, ctas, key_block", LONG_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("B, Hq, Hkv, QR, D, S_max, lengths", LONG_CASES)
def test_long_form_matches_reference(B, Hq, Hkv, QR, D, S_max, lengths, dtype, cluster, ctas, key_block, monkeypatch):
    monkeypatch.setenv("BATCHD_ATTENTION_CLUSTER", cluster)
    monkeypatch.setenv("BATCHD_ATTENTION_LONG_CTAS", ctas)
    monkeypatch.setenv("BATCHD_ATTENTION_KEY_BLOCK", key_block)
    q, k, v = make(B, Hq, Hkv, QR, D, S_max, dtype)
    assert cluster_kernel.supported(q, k, v).ring, "the case must take the long form"
    seq_len = torch.tensor(lengths, device="cuda")
    out = decode_attention(q, k, v, seq_len, backend="cluster")
    ref = decode_attention_reference(q, k, v, seq_len, compute_dtype=torch.float64)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, ref) < REL_ERR[dtype]
    # the merge counters are back at zero: a second launch gives the same bits
    assert torch.equal(out, decode_attention(q, k, v, seq_len, backend="cluster"))


@needs_sm90
@pytest.mark.parametrize("cluster, ctas, key_block", LONG_LAYOUTS)
@pytest.mark.parametrize("QR, Hq, D", [(5, 6, 64), (5, 12, 128), (16, 12, 128), (11, 14, 64)],
                         ids=["G3-Q5", "G6-Q5", "G6-Q16", "G7-Q11"])
def test_long_form_verify_lane_equals_decode_step_bitwise(QR, Hq, D, cluster, ctas, key_block, monkeypatch):
    """As test_verify_lane_equals_decode_step_bitwise, on the long form: a decode step keeps its
    warp's task in registers, a wide verify parks its tasks in shared memory between key blocks, and
    lanes cross the CTAs' and the clusters' key ranges."""
    monkeypatch.setenv("BATCHD_ATTENTION_CLUSTER", cluster)
    monkeypatch.setenv("BATCHD_ATTENTION_LONG_CTAS", ctas)
    monkeypatch.setenv("BATCHD_ATTENTION_KEY_BLOCK", key_block)
    q, k, v = make(1, Hq, 2, QR, D, 4200, torch.bfloat16, seed=3)
    p = cluster_kernel.supported(q, k, v)
    share = p.keys_per_cta
    for seq_len in (QR, share + QR - 1, share * p.cluster + 3, 4200):
        verify = decode_attention(q, k, v, torch.tensor([seq_len], device="cuda"), backend="cluster")
        for i in range(QR):
            decode = decode_attention(q[:, :, i : i + 1].contiguous(), k, v,
                                      torch.tensor([seq_len - QR + 1 + i], device="cuda"), backend="cluster")
            assert torch.equal(verify[:, :, i : i + 1], decode), f"seq_len {seq_len}: lane {i} differs"


@needs_sm90
@pytest.mark.parametrize("QR", [1, 8])
def test_long_form_settled_rows_read_early_change_no_bits(QR, monkeypatch):
    """The long form fetches its first ring blocks' settled rows before the wait: the same bits as
    without, with the new rows in the first blocks of a CTA, in later ones and across a block edge."""
    q, k, v = make(1, 12, 2, QR, 128, 4200, torch.bfloat16, seed=5)
    share = cluster_kernel.supported(q, k, v).keys_per_cta
    for length in (QR, 40, share + 33, share + 2 * 32 + 3, 4199):
        seq_len = torch.tensor([length], device="cuda")
        early = decode_attention(q, k, v, seq_len, settled=True, backend="cluster")
        assert torch.equal(early, decode_attention(q, k, v, seq_len, backend="cluster")), f"seq_len {length}"
        monkeypatch.setenv("BATCHD_EARLY_READS", "0")
        assert torch.equal(early, decode_attention(q, k, v, seq_len, settled=True, backend="cluster"))
        monkeypatch.delenv("BATCHD_EARLY_READS")


@needs_sm90
def test_long_form_never_reads_rows_past_seq_len():
    q, k, v = make(2, 12, 2, 3, 128, 4200, torch.bfloat16)
    seq_len = torch.tensor([3001, 37], device="cuda")
    clean = decode_attention(q, k, v, seq_len, backend="cluster")
    k[0, :, 3001:], v[0, :, 3001:] = float("nan"), float("nan")
    k[1, :, 37:], v[1, :, 37:] = float("nan"), float("inf")
    assert torch.equal(decode_attention(q, k, v, seq_len, backend="cluster"), clean)


@needs_sm90
def test_long_form_graph_replay_follows_seq_len():
    q, k, v = make(1, 12, 2, 1, 128, 4200, torch.bfloat16, seed=9)
    seq_len = torch.tensor([3000], device="cuda")
    decode_attention(q, k, v, seq_len, backend="cluster")     # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, seq_len, backend="cluster")
    for length in (3000, 3001, 1, 4199):
        seq_len.fill_(length)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, decode_attention(q, k, v, seq_len, backend="cluster")), f"seq_len {length}"
