"""bench/stream_probe.py's float32 reference, which the CUDA probe is checked against on the GPU:
its rope is the engine's rotate-half rope, and its attention step is grouped-query attention over
the cache plus the new token (the new key roped and rounded to bf16, as the cache stores keys).
Also its packed weight layout (mode bit 11): each chunk where the producer's one copy reads it."""
import pytest
import torch
import torch.nn.functional as F

from bench.stream_probe import pack_weights, reference, rope
from batchd.engine.fused import rotate


def test_rope_is_the_engines_rotate_half():
    torch.manual_seed(0)
    x, angles = torch.randn(3, 128), torch.rand(64) * 6
    cos, sin = angles.cos(), angles.sin()
    want = rotate(x[None, :, None], torch.cat([cos, cos])[None], torch.cat([sin, sin])[None])[0, :, 0]
    assert torch.allclose(rope(x, cos, sin), want, atol=1e-6)


def test_attention_step_is_grouped_query_attention_over_cache_and_new_token():
    """One layer whose o, gate_up and down weights are zero: h after the layer is h itself, so compare
    the o input instead by making o the identity on the attention output."""
    torch.manual_seed(0)
    hq, hkv, context, s_max, hidden, inter = 4, 2, 9, 12, 4 * 128, 256
    qkv_rows = (hq + 2 * hkv) * 128
    wqkv = (torch.randn(qkv_rows, hidden) / hidden ** 0.5).bfloat16()
    bias = (0.1 * torch.randn(qkv_rows)).bfloat16()
    eye = torch.eye(hidden).bfloat16()                       # o: h += attention output
    zeros_gu, zeros_d = torch.zeros(2 * inter, hidden).bfloat16(), torch.zeros(hidden, inter).bfloat16()
    ones = torch.ones(hidden).bfloat16()
    k_cache, v_cache = torch.randn(1, hkv, s_max, 128).bfloat16(), torch.randn(1, hkv, s_max, 128).bfloat16()
    angles = torch.rand(64) * 6
    cos, sin = angles.cos(), angles.sin()
    h = torch.randn(hidden)
    got = reference(h, [(wqkv, eye, zeros_gu, zeros_d, ones, ones, bias)], hidden, inter,
                    (k_cache, v_cache, context, cos, sin, hq, hkv)) - h

    x = (h * torch.rsqrt(h.square().mean() + 1e-6)).bfloat16().float()
    qkv = (wqkv.float() @ x + bias.float()).bfloat16().float()
    q, k, v = qkv.split([hq * 128, hkv * 128, hkv * 128])
    full_cos, full_sin = torch.cat([cos, cos])[None], torch.cat([sin, sin])[None]
    q = rotate(q.view(1, hq, 1, 128), full_cos, full_sin)
    k_new = rotate(k.view(1, hkv, 1, 128), full_cos, full_sin).bfloat16().float()
    keys = torch.cat([k_cache[:, :, :context - 1].float(), k_new], 2)
    values = torch.cat([v_cache[:, :, :context - 1].float(), v.view(1, hkv, 1, 128)], 2)
    want = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True).reshape(-1).bfloat16().float()
    assert (got - want).abs().max() < 1e-2 * want.abs().max()   # h + o rounds in float32 only


@pytest.mark.parametrize("gate_up", [False, True])
def test_packed_chunks_sit_where_the_producer_copies_them(gate_up):
    """Ragged shares (23 units over 5 CTAs: groups of 8 and fewer) and several k chunks: chunk
    (g0, k0) of rows r n is at r g0 k + k0 r n (the producer's one copy, stream_probe.cu), holding
    the group's rows (gate_up: its n gate rows, then its n up rows, as the consumers read them)."""
    grid, units, k, kc = 5, 23, 12, 4
    r = 2 if gate_up else 1
    w = torch.arange(r * units * k, dtype=torch.float32).view(r * units, k)
    packed = pack_weights(w, units, k, kc, gate_up, grid)
    seen = 0
    for c in range(grid):
        lo, hi = c * units // grid, (c + 1) * units // grid
        for g0 in range(lo, hi, 8):
            n = min(8, hi - g0)
            for k0 in range(0, k, kc):
                chunk = packed[r * g0 * k + k0 * r * n:][:r * n * kc].view(r * n, kc)
                want = [w[g0:g0 + n]] + ([w[units + g0:units + g0 + n]] if gate_up else [])
                assert torch.equal(chunk, torch.cat(want)[:, k0:k0 + kc])
                seen += chunk.numel()
    assert seen == w.numel()
