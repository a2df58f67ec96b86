"""Load the checkpoints users have: a Hugging Face folder or a GGUF file, into HF-named tensors.

    ckpt = load_checkpoint("SmolLM2-135M-Instruct.Q4_1.gguf")       # or a model folder
    ckpt.config, ckpt.tensors["model.layers.0.self_attn.q_proj.weight"], ckpt.tokenizer

Whatever the format, the result looks the same: a `ModelConfig`, tensors in Hugging Face names
and layout (GGUF data dequantised, llama.cpp's q/k row permutation undone) in the requested
dtype, a `tokenizers.Tokenizer`, the chat template and the weight files' SHA-256. Only
safetensors and GGUF are read, never pickle. Every problem with the files is a
`CheckpointError` whose message names the file and says what to do.
"""
from __future__ import annotations

from pathlib import Path

import torch

from batchd.engine.checkpoint.base import Checkpoint, files_sha256
from batchd.engine.checkpoint import gguf_file
from batchd.engine.checkpoint.gguf_file import GGUF_MAGIC
from batchd.engine.checkpoint.hf import load_hf_folder
from batchd.engine.checkpoint.validate import check_tensor_shapes
from batchd.engine.config import short_repr
from batchd.engine.errors import CheckpointError

__all__ = ["Checkpoint", "load_checkpoint"]


def load_checkpoint(path: str | Path, *, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """Load a Hugging Face model folder or a .gguf file; tensors come back in `dtype` on the CPU."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder; pass a Hugging Face model folder or a .gguf file")
    if path.is_dir():
        return load_hf_folder(path, dtype)
    if _has_gguf_magic(path):
        return load_gguf(path, dtype)
    if path.suffix == ".gguf":
        raise CheckpointError(f"{path}: not a GGUF file (no GGUF magic); download it again")
    raise CheckpointError(f"{path}: not a GGUF file; for Hugging Face weights pass the folder that "
                          f"holds config.json, not a file in it")


def load_gguf(path: Path, dtype: torch.dtype = torch.float32) -> Checkpoint:
    gguf = gguf_file.read_gguf(path)
    split_count = gguf.metadata.get("split.count", 1)
    if not isinstance(split_count, int):
        raise CheckpointError(f"{path}: metadata split.count is {short_repr(split_count)}, but it must be a whole "
                              f"number; the file is corrupt")
    if split_count > 1:
        raise CheckpointError(f"{path}: one part of a split GGUF; merge the parts first with "
                              f"`llama-gguf-split --merge` and load the merged file")
    config = gguf_file.config_from_metadata(gguf)
    shapes, source_names = gguf_file.tensor_shapes(gguf)
    check_tensor_shapes(shapes, config, str(path), source_names)
    tokenizer, chat_template, bos, eos, special = gguf_file.tokenizer_parts(gguf)
    tensors = gguf_file.load_tensors(gguf, config, dtype)
    return Checkpoint(config=config, tensors=tensors, tokenizer=tokenizer, chat_template=chat_template,
                      chat_template_source=f"{path}: metadata tokenizer.chat_template",
                      bos_token=bos, eos_token=eos, special_token_ids=special, sha256=files_sha256([path]),
                      path=str(path), format="gguf", weight_bytes=path.stat().st_size)


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC
