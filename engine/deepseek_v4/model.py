"""The DeepSeek V4 token-id model: embeddings spread over `hc_mult` residual streams, blocks of
attention (sliding / CSA / HCA) and MoE joined by hyper-connections, a final stream collapse, norm
and head. Parameter names are transformers' (DeepseekV4ForCausalLM without `model.`), except the
indexer's `scorer.weights_proj`, which is `weights_proj` here; engine.deepseek_v4.weights maps a
checkpoint's names onto them.

One `forward` serves a prefill chunk, a decode row and q verify rows: it computes positions
[cache.length, cache.length + T), writes them into the cache (engine.deepseek_v4.cache) and
returns their logits. A rejected draft is rolled back with `cache.truncate`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

import torch
from torch import nn

from batchd.engine.checkpoint.hf import _read_json, _weight_files
from batchd.engine.deepseek_v4.attention import Attention
from batchd.engine.deepseek_v4.cache import LayerCache, V4Cache
from batchd.engine.deepseek_v4.config import SLIDING, V4Config
from batchd.engine.deepseek_v4.hyper_connections import HyperConnection, HyperHead
from batchd.engine.deepseek_v4.moe import MoE
from batchd.engine.deepseek_v4.norms import RMSNorm
from batchd.engine.deepseek_v4.rope import RopeTable
from batchd.engine.deepseek_v4.rows import RowLinear, segment_positions
from batchd.engine.deepseek_v4.weights import TensorFiles, load_tensors
from batchd.engine.errors import DeviceOutOfMemoryError
from batchd.engine.residency import free_device_bytes

# parameters kept in float32 whatever the model's dtype (transformers' _keep_in_fp32_modules_strict)
FLOAT32_PARTS = ("attn_hc.", "ffn_hc.", "hc_head.", "sinks", "position_bias", "e_score_correction_bias",
                 "q_a_norm.", "kv_norm.", "input_layernorm.", "post_attention_layernorm.", "norm.")


class Block(nn.Module):
    def __init__(self, config: V4Config, layer: int):
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MoE(config, layer)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)
        self.rope_family = "main" if config.layer_types[layer] == SLIDING else "compress"

    def forward(self, streams, token_ids, positions, cache: LayerCache, start: int, rope: RopeTable):
        """streams [B, T, n, H], token_ids [B, T], positions [T] -> the next streams [B, T, n, H]."""
        return self._forward(streams, token_ids, lambda x: self.self_attn(x, positions, cache, start, rope))

    def forward_rows(self, streams, token_ids, positions, segments: list[tuple[LayerCache, int, int]],
                     rope: RopeTable):
        """The rows of several sequences (Attention.forward_rows): streams [1, N, n, H], token_ids
        [1, N], positions [N] -> [1, N, n, H]."""
        return self._forward(streams, token_ids, lambda x: self.self_attn.forward_rows(x, positions, segments, rope))

    def _forward(self, streams, token_ids, attend):
        post, comb, x = self.attn_hc(streams)
        streams = HyperConnection.merge(streams, attend(self.input_layernorm(x)), post, comb)
        post, comb, x = self.ffn_hc(streams)
        return HyperConnection.merge(streams, self.mlp(self.post_attention_layernorm(x), token_ids), post, comb)


class DeepseekV4(nn.Module):
    def __init__(self, config: V4Config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.hc_head = HyperHead(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = RowLinear(config.hidden_size, config.vocab_size, bias=False)
        self.rope: dict[str, RopeTable] = {}

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_cache(self, max_len: int, batch_size: int = 1) -> V4Cache:
        return V4Cache(self.config, max_len, self.device, self.dtype, batch_size)

    def setup_rope(self, max_len: int) -> None:
        """Both rope families' tables for `max_len` positions, on the model's device."""
        if not self.rope or self.rope["main"].cos.shape[0] < max_len:
            c = self.config
            self.rope = {"main": RopeTable(c.rope_main, c.rope_dim, max_len, self.device),
                         "compress": RopeTable(c.rope_compress, c.rope_dim, max_len, self.device)}

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: V4Cache, *, last_only: bool = False) -> torch.Tensor:
        """tokens [B, T] at positions [cache.length, cache.length + T) -> logits [B, T, V] float32
        ([B, 1, V] with last_only); the T positions are in the cache afterwards."""
        streams = self.hidden(tokens, cache)
        return self.head(streams[:, -1:] if last_only else streams)

    @torch.inference_mode()
    def hidden(self, tokens: torch.Tensor, cache: V4Cache) -> torch.Tensor:
        """tokens [B, T] -> the last layer's streams [B, T, n, H], before the head's collapse (what
        the MTP layer, engine.deepseek_v4.mtp, reads); the T positions are in the cache afterwards."""
        B, T = tokens.shape
        start = cache.length
        cache.reserve(T)
        self.setup_rope(cache.max_len)
        positions = torch.arange(start, start + T, device=tokens.device)
        streams = self.embed_tokens(tokens).unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        for layer, layer_cache in zip(self.layers, cache.layers):
            streams = layer(streams, tokens, positions, layer_cache, start, self.rope[layer.rope_family])
        cache.advance(T)
        return streams

    @torch.inference_mode()
    def hidden_rows(self, tokens: list[list[int]], caches: list) -> torch.Tensor:
        """The next rows of several sequences in one forward, each at its own cache's length:
        tokens[b] the rows of caches[b] -> the last layer's streams [1, N, n, H], N = all rows,
        sequence after sequence; each cache advances by its rows. N <= ROW_STEP keeps every row's
        bits those of its sequence's own step (engine.deepseek_v4.rows)."""
        starts = [cache.length for cache in caches]
        for cache, rows in zip(caches, tokens):
            cache.reserve(len(rows))
        self.setup_rope(max(cache.max_len for cache in caches))
        positions = segment_positions(starts, [len(rows) for rows in tokens], self.device)
        ids = torch.tensor([[t for rows in tokens for t in rows]], device=self.device)          # [1, N]
        streams = self.embed_tokens(ids).unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        for i, layer in enumerate(self.layers):
            segments = [(cache.layers[i], start, len(rows)) for cache, start, rows in zip(caches, starts, tokens)]
            streams = layer.forward_rows(streams, ids, positions, segments, self.rope[layer.rope_family])
        for cache, rows in zip(caches, tokens):
            cache.advance(len(rows))
        return streams

    def head(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [B, T, n, H] -> logits [B, T, V] float32 (stream collapse, norm, lm_head)."""
        return self.lm_head(self.norm(self.hc_head(streams))).float()


def build_model(config: V4Config, device="cpu", dtype: torch.dtype = torch.float32,
                tensors: Optional[dict[str, torch.Tensor]] = None, source: str = "checkpoint") -> DeepseekV4:
    """The model on `device`: weights in `dtype` (routing tables stay integers, the parts transformers
    keeps in float32 stay float32), loaded from `tensors` named as engine.deepseek_v4.weights
    expects (checkpoint or transformers names), or left uninitialised for the caller to fill."""
    with torch.device("meta"):
        model = DeepseekV4(config)
    allocate(model, device, dtype)
    if tensors is not None:
        load_tensors(model, tensors, source)
    return model.eval().requires_grad_(False)


def allocate(module: nn.Module, device, dtype: torch.dtype) -> None:
    """Give a module built on the meta device its storage on `device`, each parameter allocated once
    in its own dtype (float32 for the parts transformers keeps so, else `dtype`; a V4-Flash layer
    allocated in float32 first would take 26 GB) and each buffer zeroed in its dtype."""
    for name, param in list(module.named_parameters()):
        owner, _, attr = name.rpartition(".")
        kept = torch.float32 if keeps_float32(name) else dtype
        setattr(module.get_submodule(owner), attr,
                nn.Parameter(torch.empty(param.shape, dtype=kept, device=device), requires_grad=False))
    for name, buffer in list(module.named_buffers()):
        owner, _, attr = name.rpartition(".")
        module.get_submodule(owner).register_buffer(attr, torch.zeros(buffer.shape, dtype=buffer.dtype, device=device))


def parameter_bytes(config: V4Config, dtype: torch.dtype) -> int:
    """The bytes build_model allocates for `config`'s parameters in `dtype` (counted on the meta device)."""
    with torch.device("meta"):
        model = DeepseekV4(config)
    allocate(model, "meta", dtype)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def check_fits(config: V4Config, device: torch.device, dtype: torch.dtype, source: str) -> None:
    """Refuse, before allocating anything, a model whose weights alone exceed the device's free
    memory (V4-Flash is about 570 GB in bf16), with the sizes and what would make it fit."""
    needed, free = parameter_bytes(config, dtype), free_device_bytes(device)
    if needed > free:
        raise DeviceOutOfMemoryError(
            f"{source}: its {config.num_layers} layers need {needed / 1e9:.3g} GB of weights in "
            f"{str(dtype).removeprefix('torch.')} and {device} has {free / 1e9:.3g} GB free; batchd runs a model "
            "on one device and holds V4's FP8 / FP4 weights dequantised, so this checkpoint needs a device "
            "that large (or a smaller model)")


def keeps_float32(name: str) -> bool:
    return any(part in name for part in FLOAT32_PARTS)


@torch.inference_mode()
def generate_greedy(model: DeepseekV4, prompt_ids: list[int], max_new_tokens: int, *,
                    eos_ids: Iterable[int] = (), max_len: Optional[int] = None) -> list[int]:
    """Greedy tokens after `prompt_ids`: one prefill, then one decode row per token."""
    cache = model.new_cache(max_len or len(prompt_ids) + max_new_tokens)
    logits = model(torch.tensor([prompt_ids], device=model.device), cache, last_only=True)
    out, eos = [], set(eos_ids)
    while len(out) < max_new_tokens:
        out.append(int(logits[0, -1].argmax()))
        if out[-1] in eos or len(out) == max_new_tokens:
            break
        logits = model(torch.tensor([[out[-1]]], device=model.device), cache)
    return out


def load_folder(folder: str | Path, device="cpu", dtype: torch.dtype = torch.float32):
    """A Hugging Face folder holding a deepseek_v4 config.json and safetensors -> (model, SetAside).
    Token ids only: the tokenizer, if any, is the caller's. The parameters are allocated once in
    their dtypes on `device`, then filled tensor by tensor (engine.deepseek_v4.weights)."""
    folder = Path(folder)
    config = V4Config.from_hf_dict(_read_json(folder / "config.json"), source=str(folder / "config.json"))
    tensors = TensorFiles(_weight_files(folder)[0])
    check_fits(config, torch.device(device), dtype, str(folder))
    model = build_model(config, device, dtype)
    try:
        aside = load_tensors(model, tensors, str(folder))
    finally:
        tensors.close()   # (the MTP's lazy view opens its files again when build_mtp reads it)
    return model, aside
