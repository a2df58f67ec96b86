"""A `deepseek_v4` checkpoint's tensors onto engine.deepseek_v4.model's parameters.

Checkpoints name tensors as DeepSeek does (`layers.0.attn.wq_a.weight`, `ffn.experts.7.w1.weight`,
`hc_attn_fn`, ...; transformers' save_pretrained writes these too, under `model.`), and a model in
memory names them as transformers' DeepseekV4ForCausalLM does. Both map here: transformers' renaming
table (conversion_mapping.py, "deepseek_v4"), then each layer's per-expert w1/w3/w2 stacked into
`gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I].

Set aside with a note: the multi-token-prediction layer (`mtp.*`, the drafter the seed server
calls DSpark), kept for engine.deepseek_v4.mtp, which builds the drafter from it. Quantised
weights (FP8 linears, FP4 experts, with block scales) are dequantised first
(engine.deepseek_v4.quantised).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from batchd.engine.deepseek_v4.quantised import dequantised
from batchd.engine.errors import CheckpointError

# (pattern, replacement), applied in order to every name (transformers' table, same order)
RENAMES = [
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"), (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"), (r"^hc_head_base", "hc_head.hc_base"), (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"), (r"\.hc_attn_base", ".attn_hc.base"), (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"), (r"\.hc_ffn_base", ".ffn_hc.base"), (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."), (r"\.ape", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."), (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."), (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    (r"\.scorer\.weights_proj\.", ".weights_proj."),  # transformers' in-memory name -> ours
]
EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(w[123])\.weight$")


@dataclass
class SetAside:
    """What a checkpoint holds that the model does not load (reported at start)."""

    mtp: dict[str, torch.Tensor] = field(default_factory=dict)   # checkpoint name -> tensor

    @property
    def notes(self) -> list[str]:
        if self.mtp:
            return [f"the checkpoint's MTP layer ({len(self.mtp)} mtp.* tensors) is the drafter of --spec draft"]
        return ["the checkpoint has no MTP layer (mtp.* tensors): --spec draft is refused for it; "
                "--spec lookup still speculates"]


def canonical_name(name: str) -> str:
    name = name.removeprefix("model.")
    for pattern, replacement in RENAMES:
        name = re.sub(pattern, replacement, name)
    return name


def canonical_tensors(tensors: dict[str, torch.Tensor], source: str) -> tuple[dict[str, torch.Tensor], SetAside]:
    """Checkpoint or transformers names -> the model's names, quantised weights dequantised, experts stacked."""
    out, experts, aside = {}, {}, SetAside()
    for name, value in dequantised(tensors, source).items():
        if name.removeprefix("model.").startswith("mtp."):
            aside.mtp[name.removeprefix("model.")] = value
            continue
        canonical = canonical_name(name)
        match = EXPERT.match(canonical)
        if match:
            experts.setdefault(match[1], {}).setdefault(match[3], {})[int(match[2])] = value
        else:
            out[canonical] = value
    for prefix, parts in experts.items():
        out[f"{prefix}.gate_up_proj"], out[f"{prefix}.down_proj"] = _stack_experts(prefix, parts, source)
    return out, aside


def _stack_experts(prefix: str, parts: dict, source: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w1 (gate) [I, H], w3 (up) [I, H], w2 (down) [H, I] per expert -> [E, 2I, H], [E, H, I]."""
    ids = sorted(parts.get("w2", {}))
    for kind in ("w1", "w3"):
        if sorted(parts.get(kind, {})) != ids or ids != list(range(len(ids))):
            raise CheckpointError(f"{source}: {prefix} has experts {ids} for w2 but {sorted(parts.get(kind, {}))} "
                                  f"for {kind}; the checkpoint is incomplete")
    gate_up = torch.stack([torch.cat([parts["w1"][e], parts["w3"][e]], dim=0) for e in ids])
    return gate_up, torch.stack([parts["w2"][e] for e in ids])


def load_tensors(model, tensors: dict[str, torch.Tensor], source: str = "checkpoint") -> SetAside:
    """Copy a checkpoint's tensors into `model` (each parameter and buffer exactly once, shapes
    checked); -> what was set aside (`SetAside.notes` says so at start)."""
    named, aside = canonical_tensors(tensors, source)
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    missing, unexpected = sorted(set(targets) - set(named)), sorted(set(named) - set(targets))
    if missing or unexpected:
        raise CheckpointError(f"{source}: tensors do not match the deepseek_v4 layout of its config.json "
                              f"(missing {missing[:4]}, unexpected {unexpected[:4]})")
    with torch.no_grad():
        for name, value in named.items():
            target = targets[name]
            if tuple(target.shape) != tuple(value.shape):
                raise CheckpointError(f"{source}: tensor {name} has shape {tuple(value.shape)}, the config "
                                      f"expects {tuple(target.shape)}")
            target.copy_(value)
    return aside


def read_tensors_as_stored(path: Path, names: set[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys() if name in names}
    except Exception as err:  # safetensors raises its own error types for a corrupt file
        raise CheckpointError(f"{path}: cannot read tensors ({err}); download the file again") from None
