"""The widest verify step (16 drafts + 1 = 17 lanes) through the 16-lane decode-attention kernel:
lanes 0..15 against a cache one row shorter, then lane 16. Each lane must see exactly the rows of
its own decode step (lower-right causal), as one 17-lane masked attention computes them."""
from __future__ import annotations

import torch

from batchd.engine.attention import attend_kernel_lanes


def test_seventeen_lanes_match_lower_right_causal_attention():
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, D, S_max, seq_len = 1, 4, 2, 16, 64, 40
    q = torch.randn(B, Hq, 17, D, generator=g)
    k, v = torch.randn(B, Hkv, S_max, D, generator=g), torch.randn(B, Hkv, S_max, D, generator=g)
    k[:, :, seq_len:] = float("nan")  # rows past the cache length must never be read
    got = attend_kernel_lanes(q, k, v, torch.tensor([seq_len]), 0.25)
    visible = torch.arange(S_max)[None, :] <= (seq_len - 17 + torch.arange(17))[:, None]  # [17, S_max]
    keys, values = k.repeat_interleave(2, 1)[:, :, :seq_len], v.repeat_interleave(2, 1)[:, :, :seq_len]
    scores = (q @ keys.transpose(-1, -2)) * 0.25
    scores = scores.masked_fill(~visible[:, :seq_len], float("-inf"))
    want = scores.softmax(-1) @ values
    assert torch.allclose(got, want, atol=1e-5)
