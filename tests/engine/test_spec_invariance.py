"""A verify lane computes bit for bit what a one-token decode step computes, on the CPU.

Greedy speculative output can only equal plain decode's if the logits of each verify row are the
logits decode would produce for that token (and the K/V rows written are the same). A [T, K] GEMM
does not promise that: MKL picks kernels by M, and the rows move in the last bits. These tests pin
the property the CPU path relies on (engine.linear.rows_as_decode, engine.attention.attend).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.kv_cache import KVCache
from engine.linear import project
from engine.speculative.verify import certified_argmax
from tests.engine.tiny_models import ARCHITECTURES, hf_model, ours_from_hf

pytest.importorskip("transformers")


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("shape", [(960, 576), (3072, 576), (576, 1536), (49152, 576)], ids=str)
def test_projection_rows_do_not_depend_on_row_count(shape, bias):
    N, K = shape
    layer = nn.Linear(K, N, bias=bias)
    x = torch.randn(1, 17, K, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        one_by_one = torch.cat([F.linear(x[:, t : t + 1], layer.weight, layer.bias) for t in range(17)], dim=1)
        for T in (2, 3, 5, 9, 16, 17):
            assert torch.equal(project(x[:, :T], layer), one_by_one[:, :T]), f"rows differ at T={T}"


def decode_then_verify_logits(model, prompt, continuation, width):
    """Logits of `continuation` fed one token at a time, and fed in verify steps of `width` + 1."""
    with torch.inference_mode():
        cache = KVCache(model.config, 256, "cpu", torch.float32)
        model(prompt, cache)
        decoded = torch.cat([model(continuation[:, t : t + 1], cache) for t in range(continuation.shape[1])], dim=1)
        cache.reset()
        model(prompt, cache)
        verified = torch.cat([model(continuation[:, t : t + width + 1], cache)
                              for t in range(0, continuation.shape[1], width + 1)], dim=1)
    return decoded, verified


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("width", [1, 2, 4, 8, 16])
def test_verify_lanes_equal_decode_steps_bitwise(arch, width):
    model = ours_from_hf(hf_model(arch))
    tokens = torch.randint(0, 512, (1, 90), generator=torch.Generator().manual_seed(width))
    decoded, verified = decode_then_verify_logits(model, tokens[:, :40], tokens[:, 40:], width)
    assert torch.equal(decoded, verified)


def one_row_argmax(hidden: torch.Tensor, head: nn.Linear) -> torch.Tensor:
    return torch.stack([project(hidden[None, t : t + 1], head).argmax(-1).view(()) for t in range(hidden.shape[0])])


@pytest.mark.parametrize("rows", [1, 2, 5, 17])
def test_certified_head_argmax_equals_decode_argmax_even_on_near_ties(rows):
    g = torch.Generator().manual_seed(rows)
    head = nn.Linear(64, 300, bias=False)
    with torch.no_grad():
        head.weight.normal_(0, 1, generator=g)
        # token 7 is token 3 nudged by one ulp here and there: ties and near-ties everywhere
        head.weight[7] = torch.nextafter(head.weight[3], torch.full_like(head.weight[3], 1e9))
        hidden = torch.randn(rows, 64, generator=g)
        hidden[::2] = head.weight[3] * 5  # rows that pick token 3 or 7 by a hair
        assert torch.equal(certified_argmax(hidden, head), one_row_argmax(hidden, head))
