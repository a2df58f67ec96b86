"""A verify lane computes bit for bit what a one-token decode step computes, on the CPU.

Greedy speculative output can only equal plain decode's if the logits of each verify row are the
logits decode would produce for that token (and the K/V rows written are the same). A [T, K] GEMM
does not promise that: MKL picks kernels by M, and the rows move in the last bits. These tests pin
the property the CPU path relies on, on both of its routes (engine.linear: oneDNN's product over
a packed weight, or one-row products where oneDNN is not invariant; engine.attention.attend).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchd.engine import linear
from batchd.engine.kv_cache import ContiguousKVCache
from batchd.engine.linear import project
from batchd.engine.speculative.verify import certified_argmax
from tests.engine.tiny_models import ARCHITECTURES, hf_model, ours_from_hf

pytest.importorskip("transformers")


SMOLLM2_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]  # qkv, o, gate-up, down, head
ODD_SHAPES = [(192, 64), (100, 37)]
# (route, dtype) pairs: bf16 always takes the one-row products (engine.linear._pack says why)
CASES = [("onednn", torch.float32), ("one-row-products", torch.float32), ("default", torch.bfloat16)]


@pytest.fixture
def use_route(monkeypatch):
    def use(route: str):
        """Which CPU path small steps take: oneDNN where it is found invariant, else the fallback."""
        if route == "one-row-products":
            monkeypatch.setattr(linear, "_pack", lambda weight: None)
        elif route == "onednn":  # tiny weights too
            monkeypatch.setattr(linear, "ONEDNN_MIN_WEIGHTS", 0)
    return use


def linear_layer(shape, bias: bool, dtype) -> nn.Linear:
    N, K = shape
    layer = nn.Linear(K, N, bias=bias).to(dtype)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(N + K))
    return layer


def shape_cases():
    for route, dtype in CASES:
        # the fallback is slow on the head: it is the head's route only where oneDNN fails
        shapes = SMOLLM2_SHAPES if route == "onednn" else SMOLLM2_SHAPES[:4]
        for shape in shapes + ODD_SHAPES:
            yield pytest.param(route, dtype, shape, id=f"{route}-{str(dtype)[6:]}-{shape[0]}x{shape[1]}")


@pytest.mark.parametrize("route, dtype, shape", list(shape_cases()))
def test_projection_rows_do_not_depend_on_row_count(use_route, route, dtype, shape):
    use_route(route)
    for bias in (False, True):
        layer = linear_layer(shape, bias, dtype)
        x = torch.randn(1, 17, shape[1], generator=torch.Generator().manual_seed(0)).to(dtype)
        with torch.no_grad():
            one_by_one = torch.cat([project(x[:, t : t + 1], layer) for t in range(17)], dim=1)
            for T in (2, 3, 4, 5, 8, 9, 16, 17):
                assert torch.equal(project(x[:, :T], layer), one_by_one[:, :T]), f"rows differ at T={T}, bias={bias}"


@pytest.mark.parametrize("route, dtype, shape", [c for c in shape_cases() if c.values[2] in SMOLLM2_SHAPES])
def test_projection_row_does_not_depend_on_its_position_or_neighbours(use_route, route, dtype, shape):
    use_route(route)
    layer = linear_layer(shape, False, dtype)
    g = torch.Generator().manual_seed(1)
    row = torch.randn(1, 1, shape[1], generator=g).to(dtype)
    with torch.no_grad():
        alone = project(row, layer)[0, 0]
        for position in range(17):
            x = torch.randn(1, 17, shape[1], generator=g).to(dtype)
            x[0, position] = row[0, 0]
            assert torch.equal(project(x, layer)[0, position], alone), f"row moved at position {position}"


def test_fp32_small_steps_take_the_onednn_route():
    """SmolLM2's float32 shapes run as one oneDNN product per step (the fast path) where oneDNN's
    rows are invariant on this CPU: all five on the AVX2 CI machine; on an AVX512-BF16 machine
    the down projection (K = 1536) was not, and takes the one-row products (its rows are checked
    by the tests above either way). Tiny weights never take it."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("PyTorch built without oneDNN")
    routes = [linear.rows_are_invariant(linear_layer(shape, False, torch.float32)) for shape in SMOLLM2_SHAPES]
    assert sum(routes) >= 4, f"the oneDNN route is gone for SmolLM2 shapes: {dict(zip(SMOLLM2_SHAPES, routes))}"
    assert not any(linear.rows_are_invariant(linear_layer(shape, False, torch.float32)) for shape in ODD_SHAPES)


def decode_then_verify_logits(model, prompt, continuation, width):
    """Logits of `continuation` fed one token at a time, and fed in verify steps of `width` + 1."""
    with torch.inference_mode():
        cache = ContiguousKVCache(model.config, 256, "cpu", torch.float32)
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


def test_batched_route_is_taken_only_where_its_rows_equal_one_row_calls(monkeypatch):
    """Without oneDNN, a float32 step runs as one bmm of one-row products only after a check on
    random rows. A batched call whose rows move with M (a plain [M, K] GEMM stands in here for a
    BLAS that splits a batch unlike a lone product) is refused, and each row then runs alone."""
    monkeypatch.setattr(linear, "_pack", lambda weight: None)
    monkeypatch.setattr(linear, "_invariant", {})
    layer = linear_layer((256, 64), True, torch.float32)
    monkeypatch.setattr(linear, "batched_one_row_products", lambda x, lay: F.linear(x, lay.weight, lay.bias))
    assert not linear._batched_rows_are_invariant(layer.weight, layer.bias)
    x = torch.randn(1, 17, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        one_by_one = torch.cat([project(x[:, t : t + 1], layer) for t in range(17)], dim=1)
        for T in (2, 9, 17):
            assert torch.equal(project(x[:, :T], layer), one_by_one[:, :T])


@pytest.mark.parametrize("threads", [1, 3, 16])
def test_verify_lanes_equal_decode_steps_at_any_thread_count(threads):
    """A BLAS library splits one product over its threads and a batch of products over the items,
    so a row can depend on the thread count as well as on M: on a 16-thread Xeon (torch 2.11) a
    batched one-row bmm differed from one-row F.linear at N = 256, K = 64, which moved the logits
    of every tiny model's verify lanes. 16 threads on a 2-core machine still split the work 16 ways."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        layer = linear_layer((256, 64), False, torch.float32)  # this tiny MLP's gate/up
        x = torch.randn(1, 17, 64, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            one_by_one = torch.cat([project(x[:, t : t + 1], layer) for t in range(17)], dim=1)
            assert torch.equal(project(x, layer), one_by_one)
        model = ours_from_hf(hf_model("llama"))
        tokens = torch.randint(0, 512, (1, 90), generator=torch.Generator().manual_seed(threads))
        for width in (8, 16):
            decoded, verified = decode_then_verify_logits(model, tokens[:, :40], tokens[:, 40:], width)
            assert torch.equal(decoded, verified), f"width {width}"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("width", [3, 16])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # q/k/v biases; q/k norms
def test_verify_lanes_equal_decode_steps_on_the_onednn_route(use_route, arch, width):
    use_route("onednn")  # these tiny weights take the one-row products by default
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
