"""hyper_connection: the split and merge kernels against their twin, and each row's bits alone."""
from __future__ import annotations

import pytest
import torch

from batchd.kernels.hyper_connection import hc_merge, hc_merge_reference, hc_split, hc_split_reference
from tests.kernels.conftest import DEVICE, REL_ERR, needs_triton, rel_err

LOW = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # the interpreter truncates bf16

SHAPES = [
    pytest.param(5, 4, 200, id="v4-streams-partial-block"),
    pytest.param(3, 3, 64, id="padded-streams"),          # n = 3: the [4, 4] tile's padding masked
    pytest.param(2, 4, 1100, id="two-h-blocks"),
]


def inputs(rows, n, hidden, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mixes = torch.randn(rows, (2 + n) * n, generator=g) * 2
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn((2 + n) * n, generator=g) * 0.5
    streams = torch.randn(rows, n, hidden, generator=g).to(dtype)
    block_out = torch.randn(rows, hidden, generator=g).to(dtype)
    return [t.to(DEVICE) for t in (mixes, scale, base, streams, block_out)]


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, LOW], ids=["f32", "half"])
@pytest.mark.parametrize("rows, n, hidden", SHAPES)
def test_split_and_merge_match_the_twin(rows, n, hidden, dtype):
    mixes, scale, base, streams, block_out = inputs(rows, n, hidden, dtype)
    post, comb, x = hc_split(mixes, scale, base, streams, 20, 1e-6, backend="triton")
    want_post, want_comb, want_x = hc_split_reference(mixes, scale, base, streams, 20, 1e-6)
    assert rel_err(post, want_post) < 1e-6 and rel_err(comb, want_comb) < 1e-5
    assert x.dtype == dtype and rel_err(x, want_x) < REL_ERR[dtype]
    # Sinkhorn's result is nearly doubly stochastic
    assert torch.allclose(comb.sum(-2), torch.ones_like(comb.sum(-2)), atol=1e-4)
    merged = hc_merge(streams, block_out, post, comb, backend="triton")
    assert merged.dtype == dtype and rel_err(merged, hc_merge_reference(streams, block_out, post, comb)) < REL_ERR[dtype]


@needs_triton
@pytest.mark.triton
def test_a_rows_bits_are_its_own_whatever_rows_share_the_launch():
    mixes, scale, base, streams, block_out = inputs(7, 4, 300, LOW, seed=1)
    post, comb, x = hc_split(mixes, scale, base, streams, 20, 1e-6, backend="triton")
    merged = hc_merge(streams, block_out, post, comb, backend="triton")
    for row in (0, 4, 6):
        one = slice(row, row + 1)
        post1, comb1, x1 = hc_split(mixes[one], scale, base, streams[one], 20, 1e-6, backend="triton")
        assert torch.equal(post1, post[one]) and torch.equal(comb1, comb[one]) and torch.equal(x1, x[one])
        assert torch.equal(hc_merge(streams[one], block_out[one], post1, comb1, backend="triton"), merged[one])


def test_leading_axes_and_shape_errors():
    mixes, scale, base, streams, block_out = inputs(6, 4, 32, torch.float32)
    post, comb, x = hc_split(mixes.view(2, 3, -1), scale, base, streams.view(2, 3, 4, 32), 5, 1e-6)
    assert post.shape == (2, 3, 4) and comb.shape == (2, 3, 4, 4) and x.shape == (2, 3, 32)
    with pytest.raises(ValueError, match="do not fit 4 streams"):
        hc_split(mixes[:, :-1], scale, base, streams, 20, 1e-6)
    with pytest.raises(ValueError, match="at least one iteration"):
        hc_split(mixes, scale, base, streams, 0, 1e-6)
    with pytest.raises(ValueError, match="do not fit streams"):
        hc_merge(streams, block_out[:, :-1], post.view(6, 4), comb.view(6, 4, 4))
