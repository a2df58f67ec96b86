"""Load a Hugging Face model folder: config.json, model.safetensors (or shards with
model.safetensors.index.json), tokenizer.json, tokenizer_config.json (chat template, BOS/EOS).

Only safetensors are read; pickled weights (*.bin, *.pt) are refused. Every safetensors header
is checked against the file size before any tensor is read.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from batchd.engine.checkpoint.base import Checkpoint, files_sha256
from batchd.engine.checkpoint.validate import IGNORED_SUFFIXES, check_layer_count, check_tensor_shapes
from batchd.engine.config import ModelConfig
from batchd.engine.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
               "F8_E8M0": 1, "F4": 0.5}   # UE8M0 block scales; FP4, two to a byte (the shape counts values)
# An 8-byte length then a JSON header; anything claiming more than this is not a safetensors file.
MAX_HEADER_BYTES = 100 << 20


def load_hf_folder(folder: Path, dtype: torch.dtype) -> Checkpoint:
    config = _read_config(folder)
    weight_files, tensor_files = _weight_files(folder)
    shapes = {}
    for path in weight_files:
        header = read_safetensors_header(path)
        for name, shape in header.items():
            if tensor_files is not None and tensor_files.get(name) != path:
                raise CheckpointError(f"{folder / INDEX_FILE}: tensor {name} is in {path.name}, but the index "
                                      f"says {tensor_files.get(name, 'nothing')}; the index and shards disagree")
            shapes[name] = shape
    if tensor_files is not None:
        absent = [name for name in tensor_files if name not in shapes]
        if absent:
            raise CheckpointError(f"{folder / INDEX_FILE}: tensors {absent[:4]} are listed but not in their "
                                  f"shards; download the shards again")
    shapes = _drop_redundant(shapes, config)
    check_layer_count(config, len(shapes), str(folder / "config.json"), "num_hidden_layers")
    check_tensor_shapes(shapes, config, str(weight_files[0] if len(weight_files) == 1 else folder / INDEX_FILE))
    tensors = {}
    for path in weight_files:
        tensors.update(_read_tensors(path, set(shapes), dtype))
    tokenizer, (chat_template, template_source), bos, eos, special = _read_tokenizer(folder, config)
    return Checkpoint(config=config, tensors=tensors, tokenizer=tokenizer, chat_template=chat_template,
                      chat_template_source=template_source,
                      bos_token=bos, eos_token=eos, special_token_ids=special,
                      sha256=files_sha256(weight_files), path=str(folder), format="hf",
                      weight_bytes=sum(p.stat().st_size for p in weight_files))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: cannot be read as JSON ({err}); fix or replace the file") from None


def _read_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; a Hugging Face model folder needs config.json, "
                              f"{SINGLE_FILE} (or {INDEX_FILE} and its shards) and tokenizer.json")
    raw = _read_json(path)
    try:
        config = ModelConfig.from_hf_dict(raw, source=str(path))
    except CheckpointError as err:  # name the file in every message
        if str(err).startswith(str(path)):
            raise
        raise CheckpointError(f"{path}: {err}; the config is inconsistent") from None
    except (TypeError, ValueError, ZeroDivisionError) as err:
        raise CheckpointError(f"{path}: unusable value ({err}); fix the config") from None
    # generation_config.json often lists more end tokens (e.g. Llama 3 Instruct's <|eot_id|>)
    generation = folder / "generation_config.json"
    if generation.is_file():
        eos = _read_json(generation).get("eos_token_id")
        extra = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        config.eos_token_ids = list(dict.fromkeys(config.eos_token_ids + extra))
    return config


def _weight_files(folder: Path) -> tuple[list[Path], dict[str, Path] | None]:
    """The safetensors files in order, and (sharded only) tensor name -> its shard."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map; the index is corrupt, download it again")
        tensor_files = {name: folder / shard for name, shard in weight_map.items()}
        shards = sorted(set(tensor_files.values()))
        for shard in shards:
            if not shard.is_file():
                raise CheckpointError(f"{shard}: shard listed in {INDEX_FILE} is missing; download it")
        return shards, tensor_files
    single = folder / SINGLE_FILE
    if single.is_file():
        return [single], None
    pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    if pickled:
        raise CheckpointError(f"{folder}: only pickled weights ({', '.join(pickled[:3])}); batchd loads "
                              f"safetensors only (pickle can run code). Convert with transformers: "
                              f"save_pretrained(..., safe_serialization=True)")
    raise CheckpointError(f"{single}: missing (and no {INDEX_FILE}); put the model's safetensors weights "
                          f"in the folder")


def read_safetensors_header(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, after checking the header against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        n = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if n < 2 or n > min(size - 8, MAX_HEADER_BYTES):
            raise CheckpointError(f"{path}: not a safetensors file or cut short (header length {n}, file "
                                  f"{size} bytes); download it again")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise CheckpointError(f"{path}: safetensors header is corrupt; download it again") from None
    shapes, data_end = {}, 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
            shape = tuple(int(d) for d in entry["shape"])
            nbytes = math.prod(shape) * _ITEM_BYTES[entry["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: safetensors entry for {name} is malformed; the file is corrupt") from None
        if end - begin != nbytes:
            raise CheckpointError(f"{path}: tensor {name} has {end - begin} bytes for shape {list(shape)} "
                                  f"{entry['dtype']} ({nbytes} expected); the file is corrupt")
        shapes[name], data_end = shape, max(data_end, end)
    if 8 + n + data_end > size:
        raise CheckpointError(f"{path}: file is cut short ({size} bytes, the header describes "
                              f"{8 + n + data_end}); download it again")
    return shapes


def _drop_redundant(shapes: dict[str, tuple[int, ...]], config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Forget non-weights (rotary inv_freq) and a stored copy of a tied lm_head."""
    keep = {n: s for n, s in shapes.items() if not n.endswith(IGNORED_SUFFIXES)}
    if config.tie_word_embeddings:
        keep.pop("lm_head.weight", None)
    return keep


def _read_tensors(path: Path, names: set[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    tensors = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name in names:
                    tensors[name] = f.get_tensor(name).to(dtype)
    except Exception as err:  # safetensors raises its own error types for a corrupt file
        raise CheckpointError(f"{path}: cannot read tensors ({err}); download the file again") from None
    return tensors


def _read_tokenizer(folder: Path, config: ModelConfig):
    """(tokenizer, chat_template, bos_token, eos_token, special_token_ids)."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; batchd needs the fast tokenizer file (save one with "
                              f"transformers: AutoTokenizer.from_pretrained(...).save_pretrained(folder))")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for a bad file
        raise CheckpointError(f"{path}: cannot be loaded ({err}); fix or replace the file") from None
    tok_config_path = folder / "tokenizer_config.json"
    tok_config = _read_json(tok_config_path) if tok_config_path.is_file() else {}
    special = {i for i, added in tokenizer.get_added_tokens_decoder().items() if added.special}

    def token(key: str, token_id: int | None):
        # as transformers reads it: tokenizer_config.json decides, even when it says null
        # (Qwen: no BOS token although config.json has a bos_token_id); config.json otherwise
        if key in tok_config:
            value = tok_config[key]
            return value.get("content") if isinstance(value, dict) else value
        return tokenizer.id_to_token(token_id) if token_id is not None else None

    bos = token("bos_token", config.bos_token_id)
    eos = token("eos_token", config.eos_token_ids[0] if config.eos_token_ids else None)
    eos_id = tokenizer.token_to_id(eos) if eos is not None else None
    if eos_id is not None and eos_id not in config.eos_token_ids:
        config.eos_token_ids.append(eos_id)
    return tokenizer, _chat_template(folder, tok_config), bos, eos, special


def _chat_template(folder: Path, tok_config: dict) -> tuple[str | None, str]:
    """The template, and where it came from ("FILE: FIELD") for its errors."""
    source = f"{folder / 'tokenizer_config.json'}: chat_template"
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template:
        return _template_text(template, source), source
    jinja = folder / "chat_template.jinja"  # newer transformers save it beside the config
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), f"{jinja}: the template"
    legacy = folder / "chat_template.json"
    if legacy.is_file():
        source = f"{legacy}: chat_template"
        return _template_text(_read_json(legacy).get("chat_template"), source), source
    return None, source


def _template_text(template: Any, source: str) -> str | None:
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{source} is not a string; fix the file")
    return template
