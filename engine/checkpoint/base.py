"""The `Checkpoint` every loader returns, and the weight-file hash."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import torch
from tokenizers import Tokenizer

from batchd.engine.config import ModelConfig

HASH_READ_BYTES = 1 << 20


@dataclass
class Checkpoint:
    """A loaded checkpoint: config, HF-named tensors in the requested dtype, and text handling.

    tensors: HF names (model.embed_tokens.weight, model.layers.{i}.self_attn.q_proj.weight, ...,
        model.norm.weight, lm_head.weight unless tied), HF layout, on the CPU.
    sha256: of the weight file's bytes; for a sharded HF checkpoint, of the shards' hex digests
        concatenated in shard order. `sha256sum model.safetensors` / `file.gguf` gives the same.
    weight_bytes: size of the weight file(s) on disk.
    bos_token, eos_token: the strings the model's tokenizer config names (None if it names none).
        Whether encoding adds BOS is the tokenizer's own post-processor's business (on for Llama 3,
        off for SmolLM2 and Qwen), as in the original tokenizer.json.
    special_token_ids: control tokens (special added tokens), e.g. <|im_start|>.
    chat_template_source: where the chat template came from ("FILE: FIELD"), for its errors.
    """

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    chat_template: Optional[str]
    bos_token: Optional[str]
    eos_token: Optional[str]
    special_token_ids: set[int] = field(default_factory=set)
    sha256: str = ""
    path: str = ""
    format: Literal["hf", "gguf"] = "hf"
    weight_bytes: int = 0
    chat_template_source: str = ""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_READ_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def files_sha256(paths: list[Path]) -> str:
    """One file: its sha256. Several (shards, in order): sha256 of their hex digests concatenated."""
    if len(paths) == 1:
        return file_sha256(paths[0])
    return hashlib.sha256("".join(file_sha256(p) for p in paths).encode("ascii")).hexdigest()
