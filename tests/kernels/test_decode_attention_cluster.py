"""kernels.decode_attention's cluster kernel (one launch, splits merged in distributed shared
memory): its plan everywhere; on an sm_90+ GPU, against the reference, decode lanes against verify
lanes bit for bit, settled reads, rows past seq_len, CUDA graphs and the routing of backend "auto"."""
from __future__ import annotations

import ctypes

import pytest
import torch

from batchd.kernels import decode_attention
from batchd.kernels.decode_attention import cluster_kernel, decode_attention_reference
from batchd.kernels.stream_linear import cuda_supported
from tests.kernels.conftest import REL_ERR, rel_err

SM90 = torch.cuda.is_available() and cuda_supported(torch.device("cuda"))
needs_sm90 = pytest.mark.skipif(not SM90, reason="needs an sm_90+ GPU (thread-block clusters)")


def test_args_struct_matches_the_kernels_layout():
    # cluster_attention.cu's struct Args: 5 pointers, 12 strides, 6 ints and a float, the trace
    # pointer (aligned: 164 -> 168) and its row (180, padded to 184)
    assert cluster_kernel._Args.h_kv.offset == 5 * 8 + 12 * 8 and cluster_kernel._Args.qk_scale.offset == 160
    assert cluster_kernel._Args.trace.offset == 168 and ctypes.sizeof(cluster_kernel._Args) == 184


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


@pytest.mark.parametrize("s_max, D, itemsize, cluster", [
    (32768, 128, 2, 16),   # a long cache: the split and merge kernels take it
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
    """A decode step and a verify step over one cache must take the same kernel (their lanes'
    bits would differ otherwise): plan's verdict may depend on the cache, never on q_rows."""
    for s_max in range(32, 4200, 97):
        for cluster in cluster_kernel.CLUSTER_SIZES:
            verdicts = {cluster_kernel.plan(s_max, D, G, q_rows, 2, cluster) is None for q_rows in range(1, 17)}
            assert len(verdicts) == 1, f"S_max {s_max}, {cluster} CTAs"


def test_cluster_switch_is_validated(use_options):
    with pytest.raises(ValueError, match="0 \\(off\\) or one of"):
        use_options(attention_cluster=12)
    use_options(attention_cluster=0)
    assert cluster_kernel.cluster_size(2, 132) == 0
    use_options(attention_cluster=16)
    assert cluster_kernel.cluster_size(8, 132) == 16


@pytest.mark.parametrize("heads, cluster", [(2, 16), (3, 16), (4, 16), (5, 8), (8, 8), (16, 8)])
def test_default_cluster_size_follows_the_heads(heads, cluster, use_options):
    """Unset, clusters of 16 while all the heads' clusters take at most half of the 132 SMs, else 8
    (Qwen2.5-1.5B's 2 KV heads: 16; Llama-3-8B's 8: 8)."""
    use_options(attention_cluster=None)
    assert cluster_kernel.cluster_size(heads, 132) == cluster


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
def test_cluster_kernel_matches_reference(B, Hq, Hkv, QR, D, S_max, lengths, dtype, cluster, key_block, use_options):
    use_options(attention_cluster=int(cluster), attention_key_block=int(key_block))
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
def test_verify_lane_equals_decode_step_bitwise(QR, Hq, D, cluster, key_block, use_options):
    """Lane i of a Q-row verify step equals the one-row decode step at its position, bit for bit
    (greedy output may not change with speculation): lengths around the edges of the CTAs' key
    ranges and of their 32-key blocks."""
    use_options(attention_cluster=int(cluster), attention_key_block=int(key_block))
    q, k, v = make(1, Hq, 2, QR, D, 784, torch.bfloat16, seed=3)
    for seq_len in (QR, 64 + QR - 1, 514, 784):
        verify = decode_attention(q, k, v, torch.tensor([seq_len], device="cuda"), backend="cluster")
        for i in range(QR):
            decode = decode_attention(q[:, :, i : i + 1].contiguous(), k, v,
                                      torch.tensor([seq_len - QR + 1 + i], device="cuda"), backend="cluster")
            assert torch.equal(verify[:, :, i : i + 1], decode), f"seq_len {seq_len}: lane {i} differs"


@needs_sm90
@pytest.mark.parametrize("QR", [1, 8])
def test_settled_rows_read_early_change_no_bits(QR, use_options):
    """settled=True stages the rows before the step's new ones before griddepcontrol.wait: the same
    bits as settled=False and as early_reads="off", with new rows inside and across the CTAs'
    key ranges."""
    q, k, v = make(1, 12, 2, QR, 128, 784, torch.bfloat16, seed=5)
    for length in (QR, 64, 65, 70, 600, 783):
        seq_len = torch.tensor([length], device="cuda")
        early = decode_attention(q, k, v, seq_len, settled=True, backend="cluster")
        assert torch.equal(early, decode_attention(q, k, v, seq_len, backend="cluster")), f"seq_len {length}"
        use_options(early_reads="off")
        assert torch.equal(early, decode_attention(q, k, v, seq_len, settled=True, backend="cluster"))
        use_options(early_reads="auto")


@needs_sm90
def test_rows_past_seq_len_are_never_read():
    q, k, v = make(2, 12, 2, 3, 128, 784, torch.bfloat16)
    seq_len = torch.tensor([100, 37], device="cuda")
    clean = decode_attention(q, k, v, seq_len, backend="cluster")
    k[0, :, 100:], v[0, :, 100:] = float("nan"), float("nan")
    k[1, :, 37:], v[1, :, 37:] = float("nan"), float("inf")
    assert torch.equal(decode_attention(q, k, v, seq_len, backend="cluster"), clean)


@needs_sm90
def test_auto_takes_the_cluster_kernel_where_it_fits(use_options):
    """backend "auto" gives the cluster kernel's bits on a short cache, and with the switch at 0 the
    Triton kernels' (equal within rounding, not bit for bit)."""
    q, k, v = make(1, 12, 2, 1, 128, 784, torch.bfloat16, seed=7)
    seq_len = torch.tensor([500], device="cuda")
    auto = decode_attention(q, k, v, seq_len)
    assert torch.equal(auto, decode_attention(q, k, v, seq_len, backend="cluster"))
    use_options(attention_cluster=0)
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
