"""Vectorised dequantisation of GGUF tensor data, from the raw block bytes.

Each quantised format stores fixed-size blocks: `block_size` weights packed into `type_size`
bytes (scales as float16, then the packed integers). A decoder here takes the blocks of a chunk
of rows as uint8 [n_blocks, type_size] and returns float32 [n_blocks, block_size], with whole-array
numpy operations (no loop over blocks). The arithmetic follows ggml's reference operation by
operation, so results are bit-for-bit equal to `gguf.quants.dequantize`, the tests' oracle.

numpy rather than torch: these are short elementwise passes over small chunks, which numpy runs
on one core without thread start-up; torch's OpenMP pool slows them by 10-50x on a busy machine.

Block layouts (ggml-common.h):
    Q4_0  d:f16, qs[16]                       w = d * (q - 8)
    Q4_1  d:f16, m:f16, qs[16]                w = d * q + m
    Q5_0  d:f16, qh:u32, qs[16]               w = d * (q - 16), q's 5th bit from qh
    Q5_1  d:f16, m:f16, qh:u32, qs[16]        w = d * q + m
    Q8_0  d:f16, qs:i8[32]                    w = q * d
    Q4_K  d, dmin:f16, scales[12], qs[128]    8 sub-blocks of 32, 6-bit scale and min each
    Q5_K  d, dmin:f16, scales[12], qh[32], qs[128]
    Q6_K  ql[128], qh[64], scales:i8[16], d:f16   16 sub-blocks of 16
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256
# Rows are decoded in chunks of about this many weights, so the temporaries stay in cache.
CHUNK_WEIGHTS = 1 << 16

_U8 = np.uint8


def _f16(raw: np.ndarray) -> np.ndarray:
    """[n, 2] uint8 -> [n, 1] float32."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, k] uint8 -> [n, 2k] uint8: all low nibbles, then all high nibbles."""
    return np.concatenate([qs & _U8(0x0F), qs >> _U8(4)], axis=-1)


def _bits(packed: np.ndarray) -> np.ndarray:
    """[n, k] uint8 -> [n, k, 8] uint8 of bits, least significant first."""
    return np.unpackbits(packed[..., None], axis=-1, bitorder="little")


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks[:, 0:2])
    q = _nibbles(blocks[:, 2:18]).astype(np.float32) - np.float32(8)
    return d * q


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    d, m = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    q = _nibbles(blocks[:, 4:20]).astype(np.float32)
    return d * q + m


def _q5_high_bits(qh: np.ndarray) -> np.ndarray:
    """[n, 4] uint8 (a little-endian uint32) -> [n, 32] uint8, bit j for weight j."""
    return _bits(qh).reshape(qh.shape[0], 32)


def _q5_0(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks[:, 0:2])
    q = _nibbles(blocks[:, 6:22]) | (_q5_high_bits(blocks[:, 2:6]) << _U8(4))
    return d * (q.astype(np.float32) - np.float32(16))


def _q5_1(blocks: np.ndarray) -> np.ndarray:
    d, m = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    q = _nibbles(blocks[:, 8:24]) | (_q5_high_bits(blocks[:, 4:8]) << _U8(4))
    return d * q.astype(np.float32) + m


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks[:, 0:2])
    return blocks[:, 2:34].view(np.int8).astype(np.float32) * d


def _k_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack Q4_K/Q5_K's 12 bytes into 8 six-bit scales and 8 six-bit mins: [n, 8] each."""
    # bytes 0-3: scales 0-3 in the low 6 bits, top 2 bits of scales 4-7 above them
    # bytes 4-7: mins 0-3 likewise, top 2 bits of mins 4-7
    # bytes 8-11: low 4 bits of scales 4-7 (low nibble) and of mins 4-7 (high nibble)
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & _U8(0x3F), (md & _U8(0x0F)) | ((d >> _U8(2)) & _U8(0x30))], axis=-1)
    mn = np.concatenate([m & _U8(0x3F), (md >> _U8(4)) | ((m >> _U8(2)) & _U8(0x30))], axis=-1)
    return sc, mn


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 128] uint8 -> [n, 8, 32]: each 32-byte group holds two sub-blocks (low, then high nibbles)."""
    groups = qs.reshape(qs.shape[0], 4, 1, 32)
    return np.concatenate([groups & _U8(0x0F), groups >> _U8(4)], axis=2).reshape(qs.shape[0], 8, 32)


def _k_scale_offset(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K per-sub-block multiplier and offset, [n, 8, 1] each."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scales_mins(blocks[:, 4:16])
    return (d * sc.astype(np.float32)).reshape(n, 8, 1), (dmin * mn.astype(np.float32)).reshape(n, 8, 1)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    scale, offset = _k_scale_offset(blocks)
    q = _k_low_nibbles(blocks[:, 16:144]).astype(np.float32)
    return (scale * q - offset).reshape(blocks.shape[0], QK_K)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    scale, offset = _k_scale_offset(blocks)
    # qh[32]: bit s of byte j is the 5th bit of weight j of sub-block s
    high = _bits(blocks[:, 16:48]).transpose(0, 2, 1)  # [n, 8, 32]
    q = _k_low_nibbles(blocks[:, 48:176]) | (high << _U8(4))
    return (scale * q.astype(np.float32) - offset).reshape(blocks.shape[0], QK_K)


_Q6_SHIFTS = np.array([0, 2, 4, 6], dtype=_U8).reshape(1, 1, 4, 1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks[:, 208:210])
    scale = (d * scales).reshape(n, 16, 1)
    # ql[128]: two halves of 64 bytes, each giving 4 sub-blocks of 32 (low nibbles, then high)
    ql = blocks[:, 0:128].reshape(n, 2, 1, 64)
    ql = np.concatenate([ql & _U8(0x0F), ql >> _U8(4)], axis=2).reshape(n, 2, 4, 32)
    # qh[64]: two halves of 32 bytes; the 2-bit fields at shifts 0, 2, 4, 6 are the 4 sub-blocks
    qh = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> _Q6_SHIFTS) & _U8(0x03)
    q = (ql | (qh << _U8(4))).reshape(n, 16, 16).astype(np.float32) - np.float32(32)
    return (scale * q).reshape(n, QK_K)


_Q = GGMLQuantizationType
BLOCK_DECODERS: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    _Q.Q4_0: _q4_0,
    _Q.Q4_1: _q4_1,
    _Q.Q5_0: _q5_0,
    _Q.Q5_1: _q5_1,
    _Q.Q8_0: _q8_0,
    _Q.Q4_K: _q4_k,
    _Q.Q5_K: _q5_k,
    _Q.Q6_K: _q6_k,
}
SUPPORTED_TYPES = frozenset(BLOCK_DECODERS) | {_Q.F32, _Q.F16, _Q.BF16}


class UnsupportedQuantType(ValueError):
    """The loader turns this into a CheckpointError naming the file and the tensor."""


def quant_type_name(qtype: int) -> str:
    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"unknown type id {qtype}"


def dequantize_numpy(raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> np.ndarray:
    """raw: uint8 [nbytes], the tensor's bytes as stored. Returns a new float32 array of `shape`.

    `shape` is row-major (PyTorch) order, i.e. GGUF's dims reversed.
    """
    try:
        qtype = GGMLQuantizationType(qtype)
    except ValueError:
        raise UnsupportedQuantType(quant_type_name(qtype)) from None
    if qtype == _Q.F32:
        return np.array(raw, copy=True).view(np.float32).reshape(shape)  # a copy: never alias the file
    if qtype == _Q.F16:
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    if qtype == _Q.BF16:  # bfloat16 is the top half of a float32
        return (raw.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(shape)
    decode = BLOCK_DECODERS.get(qtype)
    if decode is None:
        raise UnsupportedQuantType(qtype.name)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if shape[-1] % block_size:
        raise ValueError(f"row length {shape[-1]} is not a multiple of the {qtype.name} block size {block_size}")
    blocks = raw.reshape(-1, type_size)
    out = np.empty((blocks.shape[0], block_size), dtype=np.float32)
    step = max(1, CHUNK_WEIGHTS // block_size)
    for start in range(0, blocks.shape[0], step):
        out[start:start + step] = decode(blocks[start:start + step])
    return out.reshape(shape)


def dequantize(raw: np.ndarray, qtype: int, shape: tuple[int, ...],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """As `dequantize_numpy`, as a tensor in `dtype`."""
    return to_torch(dequantize_numpy(raw, qtype, shape), dtype)


def to_torch(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """float32 array -> tensor in `dtype`, rounded to nearest-even as `Tensor.to` does."""
    if dtype == torch.float32:
        return torch.from_numpy(values)
    if dtype == torch.float16:
        with np.errstate(over="ignore"):  # beyond float16's range is inf, as in torch
            return torch.from_numpy(values.astype(np.float16))
    if dtype == torch.bfloat16:
        bits = values.view(np.uint32)
        rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
        rounded = np.where(np.isnan(values), np.uint32(0x7FC0), rounded).astype(np.uint16)
        return torch.from_numpy(rounded.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(values).to(dtype)
