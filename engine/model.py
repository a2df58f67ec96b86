"""The token-id transformer shared by target and drafter (llama, qwen2, qwen3).

The model knows nothing of text. One `forward` serves prefill chunks, one-token decode and
q-token verification: it writes the new rows' keys and values into the KV cache and lets lane t
see every cached row up to its own position (lower-right causal).

Weights load from Hugging Face tensor names (`engine.checkpoint`); q/k/v and gate/up projections
are fused into one matrix each, so a decode step reads each layer's weights in fewer launches.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from batchd.engine.attention import attend_cached, kernel_available
from batchd.engine.config import ModelConfig
from batchd.engine.errors import CheckpointError
from batchd.engine.fused import EAGER, KernelChoice, kernels_for
from batchd.engine.kv_cache import KVCache
from batchd.engine.linear import MAX_INVARIANT_ROWS, project
from batchd.engine.rope import rope_tables
from batchd.kernels.fused_mlp import fused_mlp, fused_mlp_wanted, mlp_fits
from batchd.kernels.small_matmul import qkv_rope_and_store, small_linear
from batchd.kernels.step_inputs import step_inputs

# observer(layer_idx, q [B, Hq, T, D] after rope, keys, values [B, Hkv, start+T, D], start)
AttentionObserver = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, int], None]


class RMSNorm(nn.Module):
    ops: KernelChoice = EAGER  # the model's kernel choice (Transformer.use_ops)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    ops: KernelChoice = EAGER

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.split_sizes = (q_size, kv_size, kv_size)
        self.scale = self.head_dim**-0.5
        self.rms_eps = config.rms_norm_eps

    def forward(self, hidden, norm: RMSNorm, cos, sin, cache: KVCache, layer_idx: int, start: int, positions,
                use_kernel: bool, seq_len_on_device=None, observer: Optional[AttentionObserver] = None,
                normed_inputs=None):
        """hidden: the residual stream [B, T, H] -> attention output before o_proj [B, T, Hq * D].
        `norm` (the layer's input norm) is applied first; with `normed_inputs` (kernels.small_matmul
        NormInputs of hidden for that norm) it is folded into the qkv projection, which then also
        applies rope and writes the cache rows (llama, qwen2)."""
        B, T, _ = hidden.shape
        k_cache, v_cache = cache.keys[layer_idx], cache.values[layer_idx]
        if normed_inputs is not None and self.q_norm is None:
            # projection, rope and the cache write in one launch (kernels.small_matmul.qkv_rope_and_store)
            # the step's rope rows and positions come from kernels.step_inputs: the launch just
            # before the first layer's projection, two or more launches back for every other layer
            q = qkv_rope_and_store(normed_inputs.weighted, self.qkv_proj.weight, self.qkv_proj.bias, cos=cos, sin=sin,
                                   positions=positions, k_cache=k_cache, v_cache=v_cache, num_heads=self.num_heads,
                                   num_kv_heads=self.num_kv_heads, row_sumsq=normed_inputs.sumsq, eps=norm.eps,
                                   settled=layer_idx > 0)
        else:  # qwen3's per-head q/k norm needs whole heads, which the projection's tiles do not hold
            if normed_inputs is not None:
                qkv = fused_project(normed_inputs.weighted.view(hidden.shape), self.qkv_proj,
                                    norm_inputs=normed_inputs, eps=norm.eps)  # [B, T, (Hq + 2 Hkv) D]
            else:
                qkv = project(norm(hidden), self.qkv_proj, self.ops.small_linear)
            q = self.rope_norm_and_store(qkv, cos, sin, positions, k_cache, v_cache)
        if observer is not None:
            observer(layer_idx, q, k_cache[:, :, : start + T], v_cache[:, :, : start + T], start)
        out = attend_cached(q.to(k_cache.dtype), cache, layer_idx, start, self.scale, use_kernel, seq_len_on_device)
        return out.to(hidden.dtype).transpose(1, 2).reshape(B, T, -1)

    def rope_norm_and_store(self, qkv, cos, sin, positions, k_cache, v_cache):
        """qkv [B, T, (Hq + 2 Hkv) D] -> rotated q [B, Hq, T, D], k/v rows into the caches: in one
        launch on CUDA (kernels.rope_cache), else `rope_and_store`."""
        rope_kernel = self.ops.rope_kernel
        if rope_kernel is not None and qkv.is_cuda and qkv.dtype == k_cache.dtype:
            # norm, rope and the cache write in one launch (kernels.rope_cache)
            norms = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else (None, None)
            return rope_kernel(qkv, cos, sin, positions, k_cache, v_cache, self.num_heads, self.num_kv_heads,
                               q_norm=norms[0], k_norm=norms[1], eps=self.rms_eps)
        return self.rope_and_store(qkv, cos, sin, positions, k_cache, v_cache)

    def rope_and_store(self, qkv, cos, sin, positions, k_cache, v_cache):
        """Eager twin of kernels.rope_cache: q/k norm (qwen3), rope, k/v rows into the cache.
        qkv: [B, T, (Hq + 2 Hkv) D] -> rotated q [B, Hq, T, D]."""
        B, T, _ = qkv.shape
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = self.ops.rotate(q.transpose(1, 2), cos, sin)  # [B, Hq, T, D]
        k = self.ops.rotate(k.transpose(1, 2), cos, sin)  # [B, Hkv, T, D]
        v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        k_cache.index_copy_(2, positions, k.to(k_cache.dtype))
        v_cache.index_copy_(2, positions, v.to(v_cache.dtype))
        return q


class MLP(nn.Module):
    ops: KernelChoice = EAGER

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        small = self.ops.small_linear
        return project(self.ops.silu_mul(project(x, self.gate_up_proj, small)), self.down_proj, small)


class Block(nn.Module):
    ops: KernelChoice = EAGER

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, hidden, normed_inputs, next_norm: Optional[RMSNorm], cos, sin, cache, layer_idx, start, positions,
                use_kernel, seq_len_on_device, observer):
        """hidden: the residual stream [B, T, H] -> (the stream after this layer, its NormInputs for
        `next_norm` or None; the last layer passes None: the final norm runs on its own, as the
        head-less verify path returns its output).

        With `normed_inputs` (a decode or verify step on CUDA: `decode_fusion_applies`) the layer
        runs in six launches (seven with down's k split): qkv with the input norm folded in and
        rope + cache write in its epilogue (a separate launch for qwen3's q/k norm), attention
        (split + merge), o + residual (emitting the post-attention norm's inputs), gate/up with that
        norm folded in and silu*mul, down + residual (emitting `next_norm`'s inputs); rows stay
        independent of the step's width (kernels.small_matmul). Prefill chunks and CPU steps run
        the same maths op by op and pass None."""
        attn = self.self_attn(hidden, self.input_layernorm, cos, sin, cache, layer_idx, start, positions, use_kernel,
                              seq_len_on_device, observer, normed_inputs=normed_inputs)
        post, mlp = self.post_attention_layernorm, self.mlp
        if normed_inputs is None:
            o = project(attn, self.self_attn.o_proj, self.ops.small_linear)
            hidden, normed = self.ops.add_rms_norm(o, hidden, post.weight, post.eps)
            return hidden + mlp(normed), None
        # Both residuals were written two or more launches before the projection that adds them
        # (the stream by the last layer's down or kernels.step_inputs, then by o), so the kernels
        # may read them before waiting on the launch just before (kernels._pdl, "Settled inputs").
        hidden, post_inputs = fused_project(attn, self.self_attn.o_proj, residual=hidden, emit_norm=post,
                                            settled=True)
        return self.fused_mlp(hidden, post_inputs, next_norm)

    def fused_mlp(self, hidden, post_inputs, next_norm: Optional[RMSNorm]):
        """The fused path's MLP half: the stream after attention [B, T, H] and its post-attention
        norm inputs -> (the stream after the layer, its NormInputs for `next_norm` or None).

        With down's weight stored transposed (`Transformer.use_fused_mlp`): kernels.fused_mlp, two
        launches (gate/up, silu*mul and down per slice of the intermediate axis; the ordered sum of
        the slices + residual). Otherwise the chain: gate/up with the norm folded in and silu*mul,
        then down + residual (written two launches back), three launches with down's k split."""
        mlp = self.mlp
        down_t = mlp.down_proj.weight.t()  # [I, H]
        if down_t.is_contiguous():
            rows = hidden.shape[0] * hidden.shape[1]
            result = fused_mlp(post_inputs.weighted.reshape(rows, -1), post_inputs.sumsq, mlp.gate_up_proj.weight,
                               down_t, residual=hidden.reshape(rows, -1), eps=self.post_attention_layernorm.eps,
                               emit_norm_weight=None if next_norm is None else next_norm.weight, settled=True)
            if next_norm is None:
                return result.view(hidden.shape), None
            out, inputs = result
            return out.view(hidden.shape), inputs
        act = fused_project(post_inputs.weighted.view(hidden.shape), mlp.gate_up_proj, norm_inputs=post_inputs,
                            eps=self.post_attention_layernorm.eps, gated=True)
        if next_norm is None:
            return fused_project(act, mlp.down_proj, residual=hidden, settled=True), None
        return fused_project(act, mlp.down_proj, residual=hidden, emit_norm=next_norm, settled=True)


def decode_fusion_applies(tokens: torch.Tensor, ops: KernelChoice) -> bool:
    """True for a step of few rows (tokens [B, T]) on CUDA with the invariant kernel in the
    model's kernel choice: the fused layer path."""
    return (ops.small_linear is not None and tokens.is_cuda
            and tokens.shape[0] * tokens.shape[1] <= MAX_INVARIANT_ROWS)


def fused_project(x: torch.Tensor, layer: nn.Linear, *, norm_inputs=None, eps: float = 1e-6,
                  residual: Optional[torch.Tensor] = None, gated: bool = False,
                  emit_norm: Optional[RMSNorm] = None, settled: bool = False):
    """x: [B, T, K] -> [B, T, N] through kernels.small_matmul with its fusions: x = norm_weight * h
    with `norm_inputs` (h's RMSNorm folded in), silu(gate) * up of a stacked gate/up weight
    (N = rows / 2), plus `residual` [B, T, N]; with `emit_norm`: (out, out's NormInputs for it).
    settled: the residual was written two or more launches back (small_linear)."""
    rows = x.shape[0] * x.shape[1]
    result = small_linear(
        x.reshape(rows, x.shape[-1]), layer.weight, layer.bias,
        row_sumsq=None if norm_inputs is None else norm_inputs.sumsq, eps=eps,
        residual=None if residual is None else residual.reshape(rows, -1), gated=gated,
        emit_norm_weight=None if emit_norm is None else emit_norm.weight, settled=settled,
    )
    if emit_norm is None:
        return result.view(*x.shape[:-1], -1)
    out, inputs = result
    return out.view(*x.shape[:-1], -1), inputs


class Transformer(nn.Module):
    ops: KernelChoice = EAGER  # which kernels every layer runs: `use_ops`

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope_cos: Optional[torch.Tensor] = None  # [max_len, D] float32, built by setup_rope
        self.rope_sin: Optional[torch.Tensor] = None
        self.use_attention_kernel = False

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def use_ops(self, ops: KernelChoice) -> None:
        """Run `ops` (engine.fused.KernelChoice) in every layer: the engine's choice for its device.
        Modules shared with another model (a truncated drafter's layers) follow the last call."""
        for module in self.modules():
            if isinstance(module, (Transformer, Block, Attention, MLP, RMSNorm)):
                module.ops = ops

    def setup_rope(self, max_len: int) -> None:
        """Build the rope tables for `max_len` positions on the model's device."""
        if self.rope_cos is None or self.rope_cos.shape[0] < max_len:
            self.rope_cos, self.rope_sin = rope_tables(self.config, max_len, self.device)
        self.use_attention_kernel = kernel_available(self.device)

    def forward(self, tokens: torch.Tensor, cache: KVCache, *, observer: Optional[AttentionObserver] = None,
                last_only: bool = False, head: bool = True):
        """tokens: [B, T] -> logits [B, T, V] float32 ([B, 1, V] with last_only, which spares a
        long prefill the [T, V] logits); appends T rows to `cache`. With head=False: the final
        normed hidden states [B, T, H] instead (speculative greedy verification applies the head)."""
        T = tokens.shape[1]
        cache.reserve(T)
        logits = self.forward_at(tokens, cache, cache.length, observer=observer, last_only=last_only, head=head)
        cache.advance(T)
        return logits

    def forward_at(self, tokens, cache: KVCache, start: int, *, start_on_device=None, observer=None,
                   last_only: bool = False, head: bool = True, float_logits: bool = True):
        """The step itself, without touching host state: with `start_on_device` ([1] long) the
        positions come from the device, so a captured CUDA graph replays at any cache length.
        float_logits=False leaves the logits in the model's dtype (a greedy pick needs no copy)."""
        if self.rope_cos is None or self.rope_cos.shape[0] < cache.max_len:
            self.setup_rope(cache.max_len)
        # positions [T], seq_len_on_device [1] or None, cos/sin [T, D], hidden [B, T, H], and for the
        # fused layer path the first norm's inputs: one launch on CUDA (kernels.step_inputs)
        fusion = decode_fusion_applies(tokens, self.ops)
        inputs = step_inputs(tokens, start if start_on_device is None else start_on_device, self.embed_tokens.weight,
                             self.rope_cos, self.rope_sin, self.layers[0].input_layernorm.weight if fusion else None,
                             backend="auto" if fusion else "reference")
        positions, seq_len_on_device, cos, sin, hidden, normed_inputs = inputs
        for i, layer in enumerate(self.layers):
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else None
            hidden, normed_inputs = layer(hidden, normed_inputs, next_norm, cos, sin, cache, i, start, positions,
                                          self.use_attention_kernel, seq_len_on_device, observer)
        if last_only:
            hidden = hidden[:, -1:]
        normed = self.norm(hidden)
        if not head:
            return normed
        logits = project(normed, self.lm_head, self.ops.small_linear)
        return logits.float() if float_logits else logits

    # ---- weights ---------------------------------------------------------------------------

    @torch.no_grad()
    def use_fused_mlp(self, enabled: bool = True) -> bool:
        """Store every layer's down projection weight transposed (shape [H, I], strides (1, H)), which
        routes the decode and verify MLPs through kernels.fused_mlp: its programs read their slice of
        the intermediate axis as contiguous rows of weight.t(). Prefill's F.linear takes the strided
        weight as it is. enabled=False stores it plainly again (the chain of small_linear launches).
        Idempotent; a restore after parking brings plain weights back, so the engine calls this again
        then. A change moves the weights to new storage, which CUDA graphs captured before do not
        follow: call it before capturing (Engine does, when it is built; parking drops the graphs).
        -> whether the fused MLP is on (False where the kernel does not fit the shape)."""
        enabled = enabled and mlp_fits(self.config.hidden_size, self.config.intermediate_size, self.dtype)
        for layer in self.layers:
            weight = layer.mlp.down_proj.weight
            if weight.t().is_contiguous() != enabled:
                weight.data = weight.data.t().contiguous().t() if enabled else weight.data.contiguous()
        return enabled

    def load_hf_tensors(self, tensors: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up. Every parameter must be
        filled exactly once; missing or unexpected names raise CheckpointError."""
        fused = fuse_hf_tensors(tensors, self.config)
        params = dict(self.named_parameters(remove_duplicate=True))
        missing = sorted(set(params) - set(fused))
        unexpected = sorted(set(fused) - set(params))
        if missing or unexpected:
            raise CheckpointError(
                f"{source}: tensors do not match the {self.config.architecture} layout "
                f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
            )
        with torch.no_grad():
            for name, value in fused.items():
                if params[name].shape != value.shape:
                    raise CheckpointError(
                        f"{source}: tensor {name} has shape {tuple(value.shape)}, "
                        f"config expects {tuple(params[name].shape)}"
                    )
                params[name].copy_(value)


def fuse_hf_tensors(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """HF names -> this module's names (model. prefix dropped, q/k/v and gate/up concatenated)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        out[name.removeprefix("model.")] = value
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    for i in range(config.num_layers):
        attn, mlp = f"layers.{i}.self_attn", f"layers.{i}.mlp"
        for kind in ("weight", "bias"):
            parts = [out.pop(f"{attn}.{p}_proj.{kind}", None) for p in "qkv"]
            if all(p is not None for p in parts):
                out[f"{attn}.qkv_proj.{kind}"] = torch.cat(parts, dim=0)
        gate, up = out.pop(f"{mlp}.gate_proj.weight", None), out.pop(f"{mlp}.up_proj.weight", None)
        if gate is not None and up is not None:
            out[f"{mlp}.gate_up_proj.weight"] = torch.cat([gate, up], dim=0)
    return out


def unfuse_hf_tensors(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of `fuse_hf_tensors`: this module's names -> HF names (model. prefix, q/k/v and
    gate/up split again), for writing a checkpoint. A tied lm_head is left out, as HF writes it."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        if name == "lm_head.weight":
            if not config.tie_word_embeddings:
                out[name] = value
        elif ".qkv_proj." in name:
            for part, piece in zip("qkv", value.split([q_size, kv_size, kv_size], dim=0)):
                out["model." + name.replace("qkv_proj", f"{part}_proj")] = piece
        elif ".gate_up_proj." in name:
            for part, piece in zip(("gate", "up"), value.chunk(2, dim=0)):
                out["model." + name.replace("gate_up_proj", f"{part}_proj")] = piece
        else:
            out["model." + name] = value
    return out


def choose_fused_mlp(model: Transformer) -> bool:
    """Decode and verify MLPs in two launches instead of three (kernels.fused_mlp) on the shapes
    where that measured faster (BATCHD_FUSED_MLP=1 forces it, 0 turns it off): only on CUDA with
    the invariant kernels in the model's choice. down's weight is stored transposed for it. Its
    sums of down run in another order than the chain's, so the engine records the path in the
    fingerprint. -> whether the fused MLP is on."""
    config = model.config
    return model.use_fused_mlp(
        model.device.type == "cuda" and model.ops.decode_kernels
        and fused_mlp_wanted(config.hidden_size, config.intermediate_size, model.dtype))


def build_model(config: ModelConfig, device: str, dtype: torch.dtype, *, tensors=None, source="checkpoint",
                seed: int = 0, ops: Optional[KernelChoice] = None) -> Transformer:
    """Build on the target device in `dtype`; load tensors, or fill random weights. `ops`: the
    kernels it runs (default: the device's choice, engine.fused.kernels_for)."""
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if tensors is not None:
        model.load_hf_tensors(tensors, source)
    else:
        init_random(model, seed)
    model.use_ops(ops if ops is not None else kernels_for(device))
    return model.eval().requires_grad_(False)


@torch.no_grad()
def init_random(model: Transformer, seed: int) -> None:
    generator = torch.Generator(device=model.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=generator)
