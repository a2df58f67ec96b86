"""Read a GGUF file (llama.cpp's format) into Hugging Face-named tensors, a config and a tokenizer.

The header (metadata and tensor table) is parsed here with `struct` over a memory map; the
`gguf` package's GGUFReader gives the same answer (the tests compare them) but builds a numpy
view per metadata item, which takes seconds on a 49k-token vocabulary. Tensor data is read
straight from the map and dequantised by `dequant.py`.

Layout (little-endian): magic "GGUF", version u32 (2 or 3), tensor count u64, metadata count
u64, metadata (key string, value type u32, value), tensor infos (name, n_dims u32, dims u64 each,
type u32, offset u64), padding to `general.alignment` (32), then the tensor data. Dims are
innermost first, so a [rows, cols] matrix is stored with dims (cols, rows).
"""
from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from batchd.engine.architectures import GGUF_ARCHITECTURES, architecture
from batchd.engine.checkpoint import dequant
from batchd.engine.checkpoint.gguf_tokenizer import GGUFTokenizerError, build_tokenizer, control_token_ids
from batchd.engine.checkpoint.validate import check_layer_count
from batchd.engine.config import ConfigValueError, ModelConfig, check_rope_scaling, short_repr
from batchd.engine.errors import CheckpointError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
# The fewest bytes each header entry takes, to bound the counts in the header by the file's size
# before looping over them: a metadata item (key length, value type, a one-byte value), a tensor
# info (name length, dim count, type, offset), a nested array (element type, count).
_MIN_KV_BYTES, _MIN_TENSOR_INFO_BYTES, _ARRAY_HEADER_BYTES = 8 + 4 + 1, 8 + 4 + 4 + 8, 4 + 8
MAX_ARRAY_DEPTH = 8


# GGUF tensor name -> HF tensor name; per-layer names are blk.{i}.<key> -> model.layers.{i}.<value>
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# llama.cpp's llama-architecture rope wants interleaved pairs, so convert_hf_to_gguf.py permutes
# the rows of q and k (and their biases) per head; we undo it.
_PERMUTED = {"attn_q.weight": "q", "attn_k.weight": "k", "attn_q.bias": "q", "attn_k.bias": "k"}
ROPE_FREQS = "rope_freqs.weight"


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: innermost first
    qtype: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Row-major (PyTorch) shape."""
        return tuple(reversed(self.dims))

    @property
    def type_name(self) -> str:
        return dequant.quant_type_name(self.qtype)


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]
    data: np.ndarray  # uint8 view of the whole file (a private memory map)

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as stored: uint8 [nbytes], a view of the map."""
        return self.data[info.offset:info.offset + info.nbytes]


class _Header:
    """A cursor over the file's bytes; every read past the end is a truncated-file error."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise CheckpointError(
                f"{self.path}: GGUF header is cut short or corrupt while reading {what} "
                f"(needs byte {self.pos + n}, file has {self.size}); download it again")

    def scalar(self, fmt: str, what: str):
        size = struct.calcsize("<" + fmt)
        self.need(size, what)
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self, what: str) -> str:
        n = self.scalar("Q", what)
        self.need(n, what)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.path}: {what} is not valid UTF-8; the file is corrupt") from None

    def strings(self, count: int, what: str) -> list[str]:
        # the hot loop of a 50k-150k token vocabulary: kept tight, bounds checked once at the end
        unpack, buf, pos, raw = _U64.unpack_from, self.buf, self.pos, []
        try:
            for _ in range(count):
                (n,) = unpack(buf, pos)
                raw.append(buf[pos + 8:pos + 8 + n])
                pos += 8 + n
        except struct.error:
            pos = self.size + 1
        if pos > self.size:
            self.need(pos - self.pos, what)
        self.pos = pos
        try:
            return [item.decode("utf-8") for item in raw]
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.path}: {what} is not valid UTF-8; the file is corrupt") from None

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:  # llama.cpp writes flat arrays; 20,000 levels would overflow the stack
                raise CheckpointError(f"{self.path}: {what} nests arrays more than {MAX_ARRAY_DEPTH} deep; "
                                      f"the file is corrupt")
            etype = self.scalar("I", what)
            count = self.scalar("Q", what)
            if etype in _NUMPY:
                itemsize = np.dtype(_NUMPY[etype]).itemsize
                self.need(count * itemsize, what)
                values = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=count, offset=self.pos)
                self.pos += count * itemsize
                return values.tolist()
            if etype == _STRING:
                self.need(count * 8, what)  # each string has at least its length
                return self.strings(count, what)
            if etype == _ARRAY:
                self.need(count * _ARRAY_HEADER_BYTES, what)  # each one has at least its type and count
                return [self.value(_ARRAY, what, depth + 1) for _ in range(count)]
        raise CheckpointError(f"{self.path}: unknown GGUF value type {vtype} in {what}; the file is corrupt")


def read_gguf(path: Path) -> GGUFFile:
    """Parse the header and map the file. Checks that every tensor's bytes lie inside the file."""
    size = path.stat().st_size
    if size < 24:
        raise CheckpointError(f"{path}: {size} bytes is too short to be a GGUF file; download it again")
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    header = _Header(buf, path)
    if buf[:4] != GGUF_MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (no GGUF magic); pass a .gguf file or a model folder")
    header.pos = 4
    version = header.scalar("I", "version")
    if version not in (2, 3):
        hint = " (a big-endian file?)" if version > 0xFFFF else ""
        raise CheckpointError(f"{path}: GGUF version {version}{hint} is not supported; re-convert with a "
                              f"current llama.cpp (versions 2 and 3 are read)")
    n_tensors = header.scalar("Q", "tensor count")
    n_kv = header.scalar("Q", "metadata count")
    if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > size - header.pos:
        raise CheckpointError(f"{path}: GGUF header is cut short or corrupt: tensor count {n_tensors} and metadata "
                              f"count {n_kv} need more than the file's {size} bytes; download it again")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = header.string("a metadata key")
        vtype = header.scalar("I", f"metadata {key!r}")
        metadata[key] = header.value(vtype, f"metadata {key!r}")
    infos = []
    for _ in range(n_tensors):
        name = header.string("a tensor name")
        n_dims = header.scalar("I", f"tensor {name!r}")
        if n_dims > 8:
            raise CheckpointError(f"{path}: tensor {name!r} has {n_dims} dims; the file is corrupt")
        dims = tuple(header.scalar("Q", f"tensor {name!r}") for _ in range(n_dims))
        qtype = header.scalar("I", f"tensor {name!r}")
        offset = header.scalar("Q", f"tensor {name!r}")
        infos.append((name, dims, qtype, offset))
    alignment = _alignment(path, metadata)
    data_start = -(-header.pos // alignment) * alignment
    tensors = [_tensor_info(path, size, data_start, *info) for info in infos]
    return GGUFFile(path, version, metadata, tensors, np.frombuffer(buf, dtype=np.uint8))


def _alignment(path: Path, metadata: dict[str, Any]) -> int:
    """`general.alignment`: a power of two, as llama.cpp requires (0 would divide by zero)."""
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise CheckpointError(f"{path}: metadata general.alignment is {short_repr(alignment)}, but it must be a power "
                              f"of two ({DEFAULT_ALIGNMENT} when absent); the file is corrupt")
    return alignment


def _tensor_info(path: Path, file_size: int, data_start: int, name: str, dims: tuple[int, ...],
                 qtype: int, offset: int) -> GGUFTensorInfo:
    try:
        qtype_enum = GGMLQuantizationType(qtype)
    except ValueError:
        raise CheckpointError(f"{path}: tensor {name!r} has unknown GGUF type id {qtype}; "
                              f"re-quantise it to Q4_K/Q6_K/Q8_0 (or F16) with llama.cpp") from None
    block_size, type_size = GGML_QUANT_SIZES[qtype_enum]
    numel = math.prod(dims)
    if dims and dims[0] % block_size:
        raise CheckpointError(f"{path}: tensor {name!r} row length {dims[0]} is not a multiple of its "
                              f"{qtype_enum.name} block size {block_size}; the file is corrupt")
    nbytes = numel // block_size * type_size
    start = data_start + offset
    if start + nbytes > file_size:
        raise CheckpointError(
            f"{path}: file is cut short: tensor {name!r} needs bytes {start}..{start + nbytes} but the "
            f"file has {file_size}; download it again")
    return GGUFTensorInfo(name, dims, qtype, start, nbytes)


def hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def undo_rope_permutation(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf.py's `permute`: rows [n_head, 2, d/2] were stored as [n_head, d/2, 2]."""
    head_dim = weight.shape[0] // n_head
    heads = weight.reshape(n_head, head_dim // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(heads.swapaxes(1, 2)).reshape(weight.shape)


def config_from_metadata(gguf: GGUFFile) -> ModelConfig:
    meta, path = gguf.metadata, gguf.path
    arch_name = meta.get("general.architecture")
    arch = GGUF_ARCHITECTURES.get(arch_name) if isinstance(arch_name, str) else None
    if arch is None:
        raise CheckpointError(f"{path}: unsupported architecture {arch_name!r}; batchd runs "
                              f"{', '.join(GGUF_ARCHITECTURES)}")

    def key(name: str, default: Any = KeyError, kind: type = int) -> Any:
        """The value of `<arch>.<name>`, a number of `kind` (float: as the original config had it)."""
        value = meta.get(f"{arch_name}.{name}", default)
        if value is KeyError:
            raise CheckpointError(f"{path}: missing metadata {arch_name}.{name}; the file is incomplete")
        if isinstance(value, list):  # per-layer values; we need them all equal
            if not value or any(v != value[0] for v in value):
                raise CheckpointError(f"{path}: {arch_name}.{name} differs per layer ({value[:4]}...), "
                                      f"which batchd does not support")
            value = value[0]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or (kind is int and isinstance(value, float)):
            raise CheckpointError(f"{path}: metadata {arch_name}.{name} is {short_repr(value)}, but it must be a "
                                  f"{'whole number' if kind is int else 'number'}; the file's metadata is corrupt")
        return _short_float(value) if kind is float else value

    names = {t.name for t in gguf.tensors}
    heads = key("attention.head_count")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    eos_ids = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                 "tokenizer.ggml.eom_token_id") if k in meta]
    try:
        config = ModelConfig(
            architecture=arch,
            vocab_size=len(tokens) if isinstance(tokens, list) and tokens else key("vocab_size"),
            hidden_size=key("embedding_length"),
            num_layers=key("block_count"),
            num_heads=heads,
            num_kv_heads=key("attention.head_count_kv", heads),
            intermediate_size=key("feed_forward_length"),
            head_dim=key("attention.key_length", 0),
            rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-5, float),
            rope_theta=key("rope.freq_base", 10000.0, float),
            max_position_embeddings=key("context_length", 4096),
            tie_word_embeddings="output.weight" not in names,
            attention_bias=architecture(arch).has_attention_bias_gguf(names),
            qk_norm=architecture(arch).qk_norm,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=list(dict.fromkeys(eos_ids)),
        )
    except ConfigValueError as err:
        raise CheckpointError(f"{path}: {err.describe(f'metadata {arch_name}.{_GGUF_KEYS[err.field]}')}; "
                              f"the file's metadata is corrupt or inconsistent") from None
    except CheckpointError as err:
        raise CheckpointError(f"{path}: {err}; the file's metadata is inconsistent") from None
    # Every size below is taken from the tensor table, which the file's size bounds; the layer
    # count is not, and validation loops over it: 10^9 layers would never finish.
    check_layer_count(config, len(gguf.tensors), str(path), f"metadata {arch_name}.block_count")
    config.rope_scaling = _rope_scaling(gguf, arch_name, config)
    return config


# ModelConfig field -> GGUF metadata key after `<arch>.`
_GGUF_KEYS = {"vocab_size": "vocab_size", "hidden_size": "embedding_length", "num_layers": "block_count",
              "num_heads": "attention.head_count", "num_kv_heads": "attention.head_count_kv",
              "intermediate_size": "feed_forward_length", "head_dim": "attention.key_length",
              "rms_norm_eps": "attention.layer_norm_rms_epsilon", "rope_theta": "rope.freq_base",
              "max_position_embeddings": "context_length", "rope_scaling.factor": "rope.scaling.factor"}


def _short_float(value: float) -> float:
    """GGUF stores float32: 1e-6 comes back as 9.99999997e-07. Return the shortest decimal that is
    the same float32 (1e-6), as the original config.json had it; identical once cast to float32."""
    return float(str(np.float32(value)))


def _rope_scaling(gguf: GGUFFile, arch_name: str, config: ModelConfig) -> dict | None:
    meta = gguf.metadata
    prefix = f"{arch_name}.rope.scaling."
    kind = meta.get(prefix + "type")
    factor = meta.get(prefix + "factor")
    original = meta.get(prefix + "original_context_length")
    factor_key = prefix + "factor"
    if kind is None and meta.get(f"{arch_name}.rope.scale_linear"):  # older files
        factor_key = f"{arch_name}.rope.scale_linear"
        kind, factor = "linear", meta[factor_key]
    freqs = next((t for t in gguf.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None and kind in (None, "none"):
        return _llama3_scaling_from_factors(gguf, freqs, original, config)
    if kind in (None, "none"):
        return None
    try:
        check_rope_scaling({"factor": factor})
    except ConfigValueError as err:
        raise CheckpointError(f"{gguf.path}: {err.describe(f'metadata {factor_key}')}; the file's metadata is corrupt "
                              f"or inconsistent") from None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _short_float(factor)}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": _short_float(factor)}
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                                 ("yarn_attn_factor", "attention_factor")):
            if prefix + gguf_key in meta:
                scaling[hf_key] = _short_float(meta[prefix + gguf_key])
        return scaling
    raise CheckpointError(f"{gguf.path}: rope scaling type {kind!r} is not supported (linear, yarn, llama3 are)")


def llama3_rope_factors(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """The per-frequency divisors convert_hf_to_gguf.py stores as rope_freqs.weight for Llama 3.1+."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / freqs
    smooth = (old_context / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    factors = torch.where(wavelen > old_context / low, torch.full_like(freqs, factor), blended)
    return torch.where(wavelen < old_context / high, torch.ones_like(freqs), factors)


def _llama3_scaling_from_factors(gguf: GGUFFile, info: GGUFTensorInfo, original: int | None,
                                 config: ModelConfig) -> dict | None:
    # llama.cpp keeps only the factors; recover Llama 3's parameters by matching them.
    factors = torch.from_numpy(dequant.dequantize_numpy(gguf.raw(info), info.qtype, info.shape))
    if torch.all(factors == 1):
        return None
    scaling = {"rope_type": "llama3", "factor": _short_float(float(factors.max())), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": int(original or 8192)}
    expected = llama3_rope_factors(config.head_dim, config.rope_theta, scaling)
    if expected.shape == factors.shape and torch.allclose(expected, factors, rtol=1e-4):
        return scaling
    raise CheckpointError(f"{gguf.path}: {ROPE_FREQS} does not match Llama 3 rope scaling "
                          f"(factor {scaling['factor']}, low 1, high 4); this rope scaling is not supported")


def load_tensors(gguf: GGUFFile, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Dequantise every tensor to `dtype`, in HF names and HF row order."""
    tensors = {}
    for info in gguf.tensors:
        name = hf_name(info.name)
        if name is None:
            continue  # reported as unexpected by validation; rope_freqs is read into the config
        try:
            value = dequant.dequantize_numpy(gguf.raw(info), info.qtype, info.shape)
        except dequant.UnsupportedQuantType as err:
            raise CheckpointError(
                f"{gguf.path}: tensor {info.name!r} has quantisation type {err}, which batchd does not "
                f"dequantise (supported: {', '.join(sorted(t.name for t in dequant.SUPPORTED_TYPES))}); "
                f"re-quantise the model with one of those") from None
        suffix = info.name.split(".", 2)[-1]
        if architecture(config.architecture).gguf_permuted_qk and suffix in _PERMUTED:
            n_head = config.num_heads if _PERMUTED[suffix] == "q" else config.num_kv_heads
            value = undo_rope_permutation(value, n_head)
        tensors[name] = dequant.to_torch(value, dtype)
    return tensors


def tensor_shapes(gguf: GGUFFile) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """HF name -> shape for validation, and HF name -> GGUF name for messages (unknown names kept)."""
    shapes, source_names = {}, {}
    for info in gguf.tensors:
        if info.name == ROPE_FREQS:
            continue
        name = hf_name(info.name) or info.name
        shapes[name] = info.shape
        source_names[name] = info.name
    return shapes, source_names


def tokenizer_parts(gguf: GGUFFile):
    """(tokenizer, chat_template, bos_token, eos_token, special_token_ids)."""
    meta = gguf.metadata
    try:
        tokenizer = build_tokenizer(meta)
    except GGUFTokenizerError as err:
        raise CheckpointError(f"{gguf.path}: {err}") from None
    tokens = meta["tokenizer.ggml.tokens"]
    chat_template = meta.get("tokenizer.chat_template")
    if chat_template is not None and not isinstance(chat_template, str):
        raise CheckpointError(f"{gguf.path}: metadata tokenizer.chat_template is {short_repr(chat_template)}, but it "
                              f"must be a string; the file is corrupt")

    def token(key: str):
        index = meta.get(key)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    return (tokenizer, chat_template, token("tokenizer.ggml.bos_token_id"),
            token("tokenizer.ggml.eos_token_id"), control_token_ids(meta))
