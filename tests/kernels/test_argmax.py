"""kernels.argmax against torch.argmax: exact ids, the first index on ties, every dtype, rows
wider than one block and ragged ends."""
from __future__ import annotations

import pytest
import torch

from batchd.kernels.argmax import argmax_rows, argmax_rows_reference
from tests.kernels.conftest import DEVICE, needs_triton


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("M, V", [(1, 5000), (3, 2048), (2, 7)])
def test_matches_torch_argmax(M, V, dtype):
    g = torch.Generator().manual_seed(V)
    logits = (torch.randn(M, V, generator=g) * 4).to(dtype).to(DEVICE)
    assert torch.equal(argmax_rows(logits, backend="triton"), argmax_rows_reference(logits))


@needs_triton
@pytest.mark.triton
def test_ties_take_the_first_index_across_blocks():
    from batchd.kernels.argmax.triton_kernel import BLOCK

    logits = torch.zeros(4, 3 * BLOCK + 5).to(DEVICE)
    logits[0, [7, BLOCK + 1, 2 * BLOCK]] = 3.0          # the same maximum in three blocks
    logits[1, [BLOCK + 9, BLOCK + 3]] = 2.0             # twice in one block
    logits[2] = float("-inf")                           # nothing but -inf: index 0, as torch
    logits[3, -1] = 1.0                                 # in the ragged last block
    got = argmax_rows(logits, backend="triton")
    assert got.tolist() == [7, BLOCK + 3, 0, 3 * BLOCK + 4]
    assert torch.equal(got, argmax_rows_reference(logits))


def test_bad_shape_says_what_was_given():
    with pytest.raises(ValueError, match=r"\[M, V\]"):
        argmax_rows(torch.zeros(3))


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_pick_and_advance_records_feeds_and_advances(dtype):
    from batchd.kernels.argmax import pick_and_advance
    from batchd.kernels.argmax.triton_kernel import BLOCK

    logits = torch.randn(1, 2 * BLOCK + 3, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    results = []
    for backend in ("triton", "reference"):
        picked = torch.full((8,), -1, dtype=torch.long, device=DEVICE)
        next_token = torch.zeros(1, 1, dtype=torch.long, device=DEVICE)
        length = torch.tensor([5], device=DEVICE)
        pick_and_advance(logits, picked, next_token, length, backend=backend)
        results.append((picked.tolist(), next_token.item(), length.item()))
    want = argmax_rows_reference(logits).item()
    assert results[0] == results[1] == ([-1] * 5 + [want, -1, -1], want, 6)


def test_pick_and_advance_wants_one_row():
    from batchd.kernels.argmax import pick_and_advance

    with pytest.raises(ValueError, match=r"one row \[1, V\]"):
        pick_and_advance(torch.zeros(2, 5), torch.zeros(4, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                         torch.zeros(1, dtype=torch.long))
