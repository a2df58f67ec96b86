"""kernels.argmax against torch.argmax: exact ids, the first index on ties, every dtype, rows
wider than one block and ragged ends."""
from __future__ import annotations

import pytest
import torch

from kernels.argmax import argmax_rows, argmax_rows_reference
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
    from kernels.argmax.triton_kernel import BLOCK

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
