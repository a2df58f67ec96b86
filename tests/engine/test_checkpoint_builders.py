"""Builders of tiny checkpoints for the checkpoint tests, written the way users' files are made:
Hugging Face folders by transformers' `save_pretrained`, GGUF files by the `gguf` package's
writer with the tensor names, q/k permutation and metadata of llama.cpp's convert_hf_to_gguf.py.

The tests at the bottom pin the builders themselves.
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = (
    "Summarisation of long scientific papers asks a model to read thousands of words and to write "
    "the few sentences that matter. We evaluate extractive and abstractive systems on the ACL "
    "anthology, where every paper has an abstract, an introduction and a conclusion. The results "
    "show that the models which read the whole paper outperform those that only read the abstract; "
    "the gap is largest for long papers with many tables, figures and equations (e.g. 12.5% vs 7.25%)."
)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
ARCH_EXTRAS = {
    "llama": dict(rope_theta=10000.0),
    "qwen2": dict(rope_theta=1000000.0),
    "qwen3": dict(rope_theta=1000000.0, head_dim=32),  # head_dim != hidden / heads
}
GGUF_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}


def tiny_tokenizer(vocab_size: int = 320) -> Tokenizer:
    """A byte-level BPE (GPT-2 style) trained on a paragraph: 3 special tokens, 256 bytes, merges."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([TEXT] * 4, trainer)
    return tokenizer


def tiny_hf_model(arch: str, vocab_size: int, *, tied: bool = False, seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    kwargs = dict(TINY, vocab_size=vocab_size, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
                  **ARCH_EXTRAS[arch])
    kwargs.update(overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    model = model_cls(config_cls(**kwargs)).float().eval()
    with torch.no_grad():  # norms and biases start at 1 / 0; make every tensor distinct
        for param in model.parameters():
            param.normal_(0, 0.5 if param.dim() == 1 else 0.05)
    return model


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """What our loader should return: the model's tensors, without a tied lm_head."""
    tensors = {name: t.detach().clone() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return tensors


def write_hf_folder(folder: Path, model, tokenizer: Tokenizer, *, max_shard_size: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>",
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim in effect."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def quantize_like_gguf(tensor: torch.Tensor, qtype: QT) -> torch.Tensor:
    """What a tensor becomes after a round trip through `qtype` (gguf's reference code)."""
    data = tensor.numpy().astype(np.float32)
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype).copy())


def tokenizer_metadata(tokenizer: Tokenizer) -> dict:
    vocab_size = tokenizer.get_vocab_size()
    tokens = [tokenizer.id_to_token(i) for i in range(vocab_size)]
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    types = [3 if token in SPECIAL_TOKENS else 1 for token in tokens]
    return {"tokens": tokens, "merges": merges, "types": types}


def write_gguf(path: Path, model, tokenizer: Tokenizer, *, qtype: QT = QT.F32, arch: str | None = None,
               pre: str = "gpt-2", tokenizer_model: str = "gpt2", drop: tuple[str, ...] = (),
               metadata: dict | None = None, rope_freqs: np.ndarray | None = None,
               tensor_types: dict[str, QT] | None = None) -> Path:
    """Write `model` as llama.cpp's converter would: GGUF names, q/k permuted for llama, 2-D
    weights in `qtype` (1-D in F32). `drop`: GGUF tensor names to leave out; `metadata`: extra or
    overriding keys; `tensor_types`: per-GGUF-name quant type (raw random blocks for types the
    gguf package cannot quantise)."""
    cfg = model.config
    arch = arch or cfg.model_type
    writer = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_name("tiny test model")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(_rope_theta(cfg)))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    tok = tokenizer_metadata(tokenizer)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tok["tokens"])
    writer.add_token_types(tok["types"])
    writer.add_token_merges(tok["merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for key, value in (metadata or {}).items():  # add_key_value overwrites an earlier key
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    name_map = gguf.get_tensor_name_map(GGUF_ARCH.get(arch, gguf.MODEL_ARCH.LLAMA), cfg.num_hidden_layers)
    for hf_name, tensor in hf_state_dict(model).items():
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name in drop:
            continue
        data = tensor.numpy().astype(np.float32)
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            data = llama_cpp_permute(data, cfg.num_attention_heads, cfg.num_attention_heads)
        if arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            data = llama_cpp_permute(data, cfg.num_attention_heads, cfg.num_key_value_heads)
        _add_tensor(writer, name, data, (tensor_types or {}).get(name, qtype if data.ndim == 2 else QT.F32))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return getattr(cfg, "rope_theta", None) or params.get("rope_theta", 10000.0)


def _add_tensor(writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: QT) -> None:
    if qtype == QT.F32:
        writer.add_tensor(name, data)
    elif qtype == QT.F16:
        writer.add_tensor(name, data.astype(np.float16))
    else:
        try:
            raw = gguf.quants.quantize(data, qtype)
        except NotImplementedError:
            raw = random_blocks(qtype, data.size // gguf.GGML_QUANT_SIZES[qtype][0],
                                np.random.default_rng(0)).reshape(data.shape[0], -1)
        writer.add_tensor(name, raw, raw_dtype=qtype)


def random_blocks(qtype: QT, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """n_blocks valid blocks of `qtype` as uint8 [n_blocks * type_size]: random packed integers
    and scales, with every float16 field a finite, sane value (|x| < 2)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    f16_fields = {QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q5_0: [0], QT.Q5_1: [0, 2], QT.Q8_0: [0],
                  QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [type_size - 2],
                  QT.Q2_K: [type_size - 4, type_size - 2]}[qtype]
    for offset in f16_fields:
        scales = rng.uniform(-2, 2, size=n_blocks).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(-1)


# ---- tests of the builders ----------------------------------------------------------------

def test_tiny_tokenizer_has_specials_first_and_bytes():
    tokenizer = tiny_tokenizer()
    assert [tokenizer.id_to_token(i) for i in range(3)] == SPECIAL_TOKENS
    assert tokenizer.get_vocab_size() == 320
    assert tokenizer.decode(tokenizer.encode("naïve café 42").ids) == "naïve café 42"


def test_llama_cpp_permute_interleaves_rotary_halves_per_head():
    # one head of dim 4: rows (a0, a1 | b0, b1) become (a0, b0, a1, b1)
    rows = np.arange(8, dtype=np.float32).reshape(8, 1)  # 2 heads of dim 4
    permuted = llama_cpp_permute(rows, 2, 2).ravel().tolist()
    assert permuted == [0, 2, 1, 3, 4, 6, 5, 7]
