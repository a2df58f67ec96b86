"""Windowed drafter prefill: PFlash's scoring approximation for long prompts.

    window = ScoringWindow()                 # 8192 recent keys + 128 sink keys, query blocks of 4096
    if window.applies(len(ids)):             # prompts of more than window + block tokens
        prefill_windowed(model, tokens, cache, window.attend)

Exact scoring prefills the whole prompt through the drafter with causal attention before the last
8 rows attend over every key. At 128K tokens that prefill's attention is quadratic: ~7e14 FLOPs
for a 24-layer Qwen2.5-0.5B drafter, most of the scoring time. The scores come from the tail
rows only, so the prefill's rows may see less: above `exact_tokens` = window + block tokens,
in every layer, prompt row i (query block n = i // block) sees key j iff

    j <= i  and  (j < sink  or  j >= n * block - window)

the first `sink` keys (where softmax mass with nowhere better to go settles) and the recent
context, window + 1 to window + block keys, exact causal inside. Attention then costs
S x (sink + window + block / 2) instead of S^2 / 2: at 128K tokens and the defaults, 16% of it.

What it approximates: the keys and values of rows past the first window + block were computed
from that shorter context (in every layer but the first's input). What stays exact: the tail
rows' own forward and their scoring pass over ALL keys (engine.pflash.scoring,
kernels.chunk_scoring). A prompt of at most `exact_tokens` tokens goes through the model's own
forward (every row would see every key anyway): its scores are bit-identical to exact scoring.

Measured: on the H200 (bench/pflash.py, Qwen2.5-0.5B shape, bf16) a compressed 128K-token job
scored in 0.77 s with the defaults once warm (commit 73379cf), against 1.99 s exactly. What it costs, with real weights (SmolLM2-135M on
three 8K-token aclsum papers, `bench/pflash.py --sections real --windows 1024,2048,4096
--block 512`: each row sees 1/8 to 1/2 of the paper): 96-100% of exact scoring's kept chunks
kept at keep ratio 0.1 (80-100% of those picked by score rather than as head, tail or anchor).

Each query block is one SDPA call (flash attention on CUDA) over its sink keys plus its window,
with a lower-right causal mask: no [T, S] matrix is formed. `visible_keys` is the same rule as a
dense mask, the reference the tests hold the blockwise path to.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from batchd.engine.kv_cache import KVCache
from batchd.engine.linear import project
from batchd.engine.model import Transformer

# (q [1, Hq, T, D] rows at [start, start + T), k_cache, v_cache [1, Hkv, >= start + T, D], start, scale)
#   -> [1, Hq, T, D]
PrefillAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


@dataclass(frozen=True)
class ScoringWindow:
    window: int = 8192  # recent keys before a query block's first row; a multiple of `block`
    block: int = 4096  # query rows per attention call
    sink: int = 128  # first keys every row sees

    def __post_init__(self):
        if self.block < 1 or self.window < 0 or self.sink < 0:
            raise ValueError(f"window and sink must be >= 0 and block >= 1, got {self}")
        if self.window % self.block:
            raise ValueError(f"window ({self.window}) must be a multiple of block ({self.block}): then every "
                             "prompt of at most window + block tokens is scored exactly")

    @property
    def exact_tokens(self) -> int:
        """Longest prompt scored exactly: below it every row sees every earlier key anyway."""
        return self.window + self.block

    def applies(self, tokens: int) -> bool:
        return tokens > self.exact_tokens

    def describe(self) -> str:
        return f"window {self.window} + sink {self.sink} keys, blocks of {self.block}"

    def visible_keys(self, start: int, rows: int, device=None) -> torch.Tensor:
        """[rows, start + rows] bool: which keys rows start .. start + rows - 1 see (the reference)."""
        i = torch.arange(start, start + rows, device=device)[:, None]
        j = torch.arange(start + rows, device=device)[None, :]
        return (j <= i) & ((j < self.sink) | (j >= (i // self.block) * self.block - self.window))

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
               scale: float) -> torch.Tensor:
        """PrefillAttention over the window, one SDPA call per query block."""
        T, group = q.shape[2], q.shape[1] // k_cache.shape[1]
        out = torch.empty_like(q)
        a = start
        while a < start + T:
            first = a // self.block * self.block  # the block's first row
            b = min(first + self.block, start + T)
            lo = first - self.window  # keys [sink, lo) are hidden from the block
            if lo <= self.sink:
                keys, values = k_cache[:, :, :b], v_cache[:, :, :b]
            else:
                keys = torch.cat([k_cache[:, :, : self.sink], k_cache[:, :, lo:b]], dim=2)
                values = torch.cat([v_cache[:, :, : self.sink], v_cache[:, :, lo:b]], dim=2)
            # KV heads repeated for the query heads: a [Hq, window, D] copy is small, and plain
            # MHA keeps SDPA on its fused lower-right-causal kernels (flash, memory-efficient)
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
            out[:, :, a - start : b - start] = F.scaled_dot_product_attention(
                q[:, :, a - start : b - start], keys, values, attn_mask=causal_lower_right(b - a, keys.shape[2]),
                scale=scale)
            a = b
        return out

    def attend_reference(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
                         scale: float) -> torch.Tensor:
        """The same attention through one dense [T, start + T] mask (tests, small sizes)."""
        T = q.shape[2]
        mask = self.visible_keys(start, T, q.device)
        return F.scaled_dot_product_attention(q, k_cache[:, :, : start + T], v_cache[:, :, : start + T],
                                              attn_mask=mask, scale=scale, enable_gqa=True)


@torch.inference_mode()
def prefill_windowed(model: Transformer, tokens: torch.Tensor, cache: KVCache, attention: PrefillAttention) -> None:
    """tokens: [1, T], appended to `cache` (keys and values of every layer), no logits.

    Transformer.forward_at's layer loop for prefill chunks (Block.forward without decode
    fusions) with `attention` in place of its attend_cached: the maths of each layer is the
    model's own (tests hold it to model.forward with exact attention, bit for bit); the last
    layer stops once its keys and values are cached.
    """
    T = tokens.shape[1]
    cache.reserve(T)
    start = cache.length
    if model.rope_cos is None or model.rope_cos.shape[0] < cache.max_len:
        model.setup_rope(cache.max_len)
    positions = torch.arange(start, start + T, device=tokens.device)
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]  # [T, D]
    hidden = model.embed_tokens(tokens)  # [1, T, H], the residual stream
    ops = model.ops  # the kernels the model's own forward runs (engine.fused.KernelChoice)
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        k_cache, v_cache = cache.keys[i], cache.values[i]
        qkv = project(layer.input_layernorm(hidden), attn.qkv_proj, ops.small_linear)  # [1, T, (Hq + 2 Hkv) D]
        if ops.rope_kernel is not None and qkv.is_cuda and qkv.dtype == k_cache.dtype:
            norms = (attn.q_norm.weight, attn.k_norm.weight) if attn.q_norm is not None else (None, None)
            q = ops.rope_kernel(qkv, cos, sin, positions, k_cache, v_cache, attn.num_heads, attn.num_kv_heads,
                                q_norm=norms[0], k_norm=norms[1], eps=attn.rms_eps)
        else:
            q = attn.rope_and_store(qkv, cos, sin, positions, k_cache, v_cache)  # [1, Hq, T, D]
        if i + 1 == len(model.layers):
            break  # the cache is complete: the last layer's output feeds nothing here
        out = attention(q.to(k_cache.dtype), k_cache, v_cache, start, attn.scale)  # [1, Hq, T, D]
        attn_out = project(out.to(hidden.dtype).transpose(1, 2).reshape(1, T, -1), attn.o_proj, ops.small_linear)
        post = layer.post_attention_layernorm
        hidden, normed = ops.add_rms_norm(attn_out, hidden, post.weight, post.eps)
        hidden = hidden + layer.mlp(normed)
    cache.advance(T)


DEFAULT_SCORING_WINDOW = ScoringWindow()
