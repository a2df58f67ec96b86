"""Our dequantisation equals the `gguf` package's numpy reference bit for bit, for every type we read.

Types the package can quantise are built from random floats with `gguf.quants.quantize`; the
K-quants (which it cannot quantise) from random block bytes with finite float16 scales.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from batchd.engine.checkpoint import dequant
from tests.engine.test_checkpoint_builders import random_blocks

QUANTISABLE = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.BF16]
K_QUANTS = [QT.Q4_K, QT.Q5_K, QT.Q6_K]
# rows x cols: one block row, several rows, and enough weights to cross decode-chunk boundaries
SHAPES = [(1, 256), (3, 512), (37, 4096)]


def _reference(raw: np.ndarray, qtype: QT, shape: tuple[int, ...]) -> torch.Tensor:
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows = raw.reshape(shape[0], shape[1] // block_size * type_size)
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(rows, qtype)))


def _ours(raw: np.ndarray, qtype: QT, shape: tuple[int, ...]) -> torch.Tensor:
    return dequant.dequantize(raw.reshape(-1), qtype, shape)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("qtype", QUANTISABLE, ids=lambda t: t.name)
def test_quantised_random_weights_match_reference(qtype, shape):
    rng = np.random.default_rng(1)
    weights = (rng.standard_normal(shape) * rng.uniform(0.01, 3, size=(shape[0], 1))).astype(np.float32)
    raw = gguf.quants.quantize(weights, qtype)
    ours, reference = _ours(raw, qtype, shape), _reference(raw, qtype, shape)
    assert ours.dtype == torch.float32 and ours.shape == shape
    assert torch.equal(ours, reference)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("qtype", K_QUANTS + [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0], ids=lambda t: t.name)
def test_random_block_bytes_match_reference(qtype, shape):
    # every bit pattern of the packed integers and 6-bit scales, not only what a quantiser emits
    block_size = gguf.GGML_QUANT_SIZES[qtype][0]
    raw = random_blocks(qtype, shape[0] * shape[1] // block_size, np.random.default_rng(2))
    ours, reference = _ours(raw, qtype, shape), _reference(raw, qtype, shape)
    assert torch.isfinite(reference).all()
    assert torch.equal(ours, reference)


def test_f16_widens_exactly():
    values = np.random.default_rng(3).standard_normal((5, 64)).astype(np.float16)
    values[0, :4] = [np.inf, -np.inf, 0.0, 6.0e-8]  # inf and a subnormal survive
    ours = dequant.dequantize(values.view(np.uint8).reshape(-1), QT.F16, values.shape)
    assert torch.equal(ours, torch.from_numpy(values.astype(np.float32)))


def test_bf16_and_f32_are_bit_exact():
    values = np.random.default_rng(4).standard_normal((4, 32)).astype(np.float32)
    assert torch.equal(dequant.dequantize(values.view(np.uint8).reshape(-1), QT.F32, values.shape),
                       torch.from_numpy(values))
    as_bf16 = torch.from_numpy(values).to(torch.bfloat16)
    raw = as_bf16.view(torch.int16).numpy().view(np.uint8).reshape(-1)
    assert torch.equal(dequant.dequantize(raw, QT.BF16, values.shape), as_bf16.float())


def test_result_does_not_alias_the_input_bytes():
    values = np.ones((2, 32), dtype=np.float32)
    raw = values.view(np.uint8).reshape(-1)
    out = dequant.dequantize(raw, QT.F32, values.shape)
    values[:] = 5
    assert torch.all(out == 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_conversion_to_half_types_rounds_like_torch(dtype):
    raw = random_blocks(QT.Q6_K, 64, np.random.default_rng(5))
    full = dequant.dequantize(raw, QT.Q6_K, (8, 2048))
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 3.0e38, 1.0e-40], dtype=np.float32)
    full[0, :7] = torch.from_numpy(special)
    half = dequant.to_torch(full.numpy().copy(), dtype)
    expected = full.to(dtype)
    assert half.dtype == dtype
    assert torch.equal(half[~expected.isnan()], expected[~expected.isnan()]) and half.isnan().sum() == 1


@pytest.mark.parametrize("qtype", [QT.Q2_K, QT.IQ2_XXS, 99], ids=["Q2_K", "IQ2_XXS", "id99"])
def test_unsupported_type_is_named(qtype):
    with pytest.raises(dequant.UnsupportedQuantType, match="Q2_K|IQ2_XXS|unknown type id 99"):
        dequant.dequantize(np.zeros(1024, dtype=np.uint8), qtype, (1, 256))


def test_types_cover_the_issue_list():
    wanted = {QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.F16, QT.BF16, QT.F32}
    assert wanted <= dequant.SUPPORTED_TYPES
