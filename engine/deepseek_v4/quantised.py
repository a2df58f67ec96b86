"""DeepSeek V4's quantised checkpoints, dequantised on load.

V4-Flash ships its linears in FP8 (e4m3, one scale per 128 x 128 block) and its routed experts in
FP4 (e2m1, two values a byte, low nibble first, one scale per 1 x 32 block); scales are float32 or
UE8M0 (a power of two: `float8_e8m0fnu`, or its exponent byte as uint8). Each quantised weight
`X.weight` has a sibling scale, `X.weight_scale_inv` (transformers' names) or `X.scale` (DeepSeek's).

    weight = value(q) * scale[block of the element]      in float32, rounded once to the model's dtype

which is transformers' own dequantisation (`integrations.finegrained_fp8.Fp8Dequantize`: the block
grid read from the scale's shape, the same float32 products), so the model holds the weights a
bf16 conversion of the checkpoint would. The hyper-connections' `hc_*_scale` (DeepSeek) and
`*_hc.scale` (transformers) tensors are parameters, not quantisation scales.
"""
from __future__ import annotations

import torch

from batchd.engine.errors import CheckpointError

# e2m1 codes 0..15 -> values (sign bit 3, two exponent bits, one mantissa bit)
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
PACKED_DTYPES = tuple(d for d in (getattr(torch, "float4_e2m1fn_x2", None),) if d is not None)   # two FP4 a byte
SCALE_SUFFIXES = (".weight_scale_inv", ".scale")
UNSUPPORTED_SUFFIXES = (".weight_scale", ".input_scale", ".weight_scale_2")   # NVFP4 / static-activation formats


def scale_of(name: str) -> str | None:
    """The weight a quantisation scale belongs to (`X.weight`), or None if `name` is no such scale
    (transformers names the hyper-connections' parameter `attn_hc.scale`)."""
    if name.endswith("_hc.scale"):
        return None
    for suffix in SCALE_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix) + ".weight"
    return None


def check_quantisation_names(names, source: str) -> dict[str, str]:
    """A checkpoint's tensor names -> {quantised weight: its scale}. A scale without its weight,
    or a format batchd does not read, is a CheckpointError that says what to do (from the names
    alone, before any tensor is read)."""
    names = set(names)
    scales = {}
    for name in names:
        if name.endswith(UNSUPPORTED_SUFFIXES):
            raise CheckpointError(f"{source}: {name} belongs to a quantisation format batchd does not read "
                                  "(it reads DeepSeek's FP8 block and FP4 expert scales); convert the "
                                  "checkpoint to bfloat16 first")
        weight_name = scale_of(name)
        if weight_name is None:
            continue
        if weight_name not in names:
            raise CheckpointError(f"{source}: {name} is a quantisation scale but the checkpoint has no "
                                  f"{weight_name}; the checkpoint is incomplete")
        scales[weight_name] = name
    return scales


def dequantise(weight: torch.Tensor, scale: torch.Tensor, what: str) -> torch.Tensor:
    """weight [..., N, K] (FP8 values, or FP4 packed as [..., N, K / 2] int8/uint8/float4_e2m1fn_x2),
    scale [..., N / bn, K / bk] -> float32 [..., N, K]: each element times its block's scale."""
    values = _fp4_values(weight) if _is_packed_fp4(weight) else weight.to(torch.float32)
    scales = (scale.to(torch.float32) - 127.0).exp2() if scale.dtype == torch.uint8 else scale.to(torch.float32)
    if scales.dim() < 2:
        scales = scales.reshape(1, 1)
    rows, cols = values.shape[-2:]
    grid_rows, grid_cols = scales.shape[-2:]
    if rows % grid_rows or cols % grid_cols or values.shape[:-2] != scales.shape[:-2]:
        raise CheckpointError(f"{what} has shape {tuple(values.shape)} and its scale {tuple(scale.shape)}: the "
                              "scale grid does not tile the weight; the checkpoint is damaged or of another format")
    block_rows, block_cols = rows // grid_rows, cols // grid_cols
    blocks = values.reshape(*values.shape[:-2], grid_rows, block_rows, grid_cols, block_cols)
    return (blocks * scales[..., :, None, :, None]).reshape(values.shape)


def _is_packed_fp4(weight: torch.Tensor) -> bool:
    return weight.dtype in (torch.int8, torch.uint8, *PACKED_DTYPES)


def _fp4_values(packed: torch.Tensor) -> torch.Tensor:
    """[..., K / 2] bytes -> float32 [..., K]: the low nibble is the even element."""
    table = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = packed.contiguous().view(torch.uint8).long()
    return torch.stack([table[codes & 0xF], table[codes >> 4]], dim=-1).reshape(*packed.shape[:-1], -1)
