"""Temporary: kernel-level EARLY vs late over seq_len, PDL on and off."""
import os, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
from kernels.decode_attention import decode_attention
from kernels.small_matmul import small_linear, qkv_rope_and_store

g = torch.Generator().manual_seed(5)
q = torch.randn(1, 12, 1, 128, generator=g).to(torch.bfloat16).cuda()
k = torch.randn(1, 2, 784, 128, generator=g).to(torch.bfloat16).cuda()
v = torch.randn(1, 2, 784, 128, generator=g).to(torch.bfloat16).cuda()
for pdl in ("1",):
    os.environ["BATCHD_PDL"] = pdl
    bad = []
    for L in range(500, 784):
        sl = torch.tensor([L], device="cuda")
        os.environ["BATCHD_EARLY_READS"] = "1"
        a = decode_attention(q, k, v, sl, settled=True); torch.cuda.synchronize()
        os.environ["BATCHD_EARLY_READS"] = "0"
        b = decode_attention(q, k, v, sl, settled=True); torch.cuda.synchronize()
        if not torch.equal(a, b):
            bad.append(L)
    print("attention PDL", pdl, "differing seq_lens", len(bad), bad[:20])
    # projections with several random inputs
    for name, N, K in (("o", 1536, 1536), ("down", 1536, 8960)):
        w = (torch.randn(N, K, generator=g) / K**0.5).to(torch.bfloat16).cuda()
        nw = (1 + 0.1 * torch.randn(N, generator=g)).to(torch.bfloat16).cuda()
        diffs = 0
        for trial in range(20):
            x = torch.randn(1, K, generator=g).to(torch.bfloat16).cuda()
            res = torch.randn(1, N, generator=g).to(torch.bfloat16).cuda()
            outs = []
            for early in ("1", "0"):
                os.environ["BATCHD_EARLY_READS"] = early
                o, ni = small_linear(x, w, residual=res, emit_norm_weight=nw, settled=True); torch.cuda.synchronize()
                outs.append((o, ni.weighted, ni.sumsq))
            diffs += any(not torch.equal(p, r) for p, r in zip(*outs))
        print(name, "PDL", pdl, "differing trials", diffs, "of 20")
    Hq, Hkv, D, H = 12, 2, 128, 1536
    N = (Hq + 2 * Hkv) * D
    w = (torch.randn(N, H, generator=g) / H**0.5).to(torch.bfloat16).cuda()
    bias = torch.randn(N, generator=g).to(torch.bfloat16).cuda()
    table = torch.randn(784, D // 2, generator=g)
    diffs = 0
    for trial in range(20):
        x = torch.randn(1, H, generator=g).to(torch.bfloat16).cuda()
        sumsq = (torch.rand(2, 1, generator=g) * 500 + 100).cuda()
        p = 500 + trial * 13
        cos = torch.cat([table[p:p + 1].cos()] * 2, -1).cuda()
        sin = torch.cat([table[p:p + 1].sin()] * 2, -1).cuda()
        outs = []
        for early in ("1", "0"):
            os.environ["BATCHD_EARLY_READS"] = early
            kc, vc = torch.zeros(1, Hkv, 784, D, dtype=torch.bfloat16, device="cuda"), torch.zeros(1, Hkv, 784, D, dtype=torch.bfloat16, device="cuda")
            qo = qkv_rope_and_store(x, w, bias, cos=cos, sin=sin, positions=torch.tensor([p], device="cuda"), k_cache=kc,
                                    v_cache=vc, num_heads=Hq, num_kv_heads=Hkv, row_sumsq=sumsq, settled=True)
            torch.cuda.synchronize()
            outs.append((qo, kc, vc))
        diffs += any(not torch.equal(a_, b_) for a_, b_ in zip(*outs))
    print("qkv PDL", pdl, "differing trials", diffs, "of 20")
