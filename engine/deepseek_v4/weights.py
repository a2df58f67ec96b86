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

Loading goes tensor by tensor: names are checked first (every parameter covered once, every
expert of every layer present), then each tensor is read from its file (`TensorFiles`), dequantised
if it has a scale, and copied into its parameter (an expert's w1 / w3 / w2 into its slice of the
stacked weights) before the next is read. A V4-Flash checkpoint (about 160 GB as stored) never
sits in host memory whole: the largest tensor read at once is one weight in float32.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from batchd.engine.checkpoint.hf import read_safetensors_header
from batchd.engine.deepseek_v4.quantised import check_quantisation_names, dequantise
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

    mtp: Mapping[str, torch.Tensor] = field(default_factory=dict)   # checkpoint name (no `model.`) -> tensor, read when asked

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


class TensorFiles(Mapping):
    """safetensors files' tensors by name, each read from its file (as stored) when asked for;
    headers are checked against the files' sizes up front. A file stays open once read from
    (opening one parses its whole header: 14 ms a tensor for a 20,000-tensor shard, where a read
    from an open file takes 10 us) until `close`; a read after that opens it again."""

    def __init__(self, files: list[Path]):
        self._file_of: dict[str, Path] = {}
        self._open: dict[Path, object] = {}
        for path in files:
            self._file_of.update(dict.fromkeys(read_safetensors_header(path), path))

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        path = self._file_of[name]
        try:
            if path not in self._open:
                self._open[path] = safe_open(str(path), framework="pt")
            return self._open[path].get_tensor(name)
        except Exception as err:  # safetensors raises its own error types for a corrupt file
            raise CheckpointError(f"{path}: cannot read {name} ({err}); download the file again") from None

    def close(self) -> None:
        self._open.clear()   # safetensors closes a file (and its map) when its handle goes

    def __iter__(self):
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)


class Renamed(Mapping):
    """A view of `source` under other names: {new name: source name}; nothing is read until asked."""

    def __init__(self, source: Mapping, names: dict[str, str]):
        self._source, self._names = source, names

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._source[self._names[name]]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@dataclass
class _Destination:
    """Where one checkpoint tensor goes: a parameter, or (an expert's w1 / w3 / w2) its slice."""

    param: str
    expert: int | None = None
    rows: slice = field(default_factory=lambda: slice(None))   # gate rows [0, I) or up rows [I, 2I) of gate_up_proj

    def of(self, target: torch.Tensor) -> torch.Tensor:
        return target if self.expert is None else target[self.expert, self.rows]


def load_tensors(model, tensors: Mapping[str, torch.Tensor], source: str = "checkpoint") -> SetAside:
    """Copy a checkpoint's tensors (a dict, or a lazy mapping such as TensorFiles) into `model`,
    one at a time: each parameter and buffer exactly once, shapes checked, quantised weights
    dequantised, experts into their slices of the stacked weights. -> what was set aside
    (`SetAside.notes` says so at start; its MTP tensors are a lazy view, read by build_mtp)."""
    names = list(tensors)
    scales = check_quantisation_names(names, source)   # {weight: its scale}
    scale_names = set(scales.values())
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    plan, experts, mtp = {}, {}, {}
    for name in names:
        if name in scale_names:   # read with its weight
            continue
        if name.removeprefix("model.").startswith("mtp."):
            mtp[name.removeprefix("model.")] = name
            continue
        canonical = canonical_name(name)
        match = EXPERT.match(canonical)
        if match is None:
            plan[name] = _Destination(canonical)
            continue
        prefix, expert, kind = match[1], int(match[2]), match[3]
        experts.setdefault(prefix, {}).setdefault(kind, set()).add(expert)
        if kind == "w2":
            plan[name] = _Destination(f"{prefix}.down_proj", expert)
        else:
            half = targets[f"{prefix}.gate_up_proj"].shape[1] // 2 if f"{prefix}.gate_up_proj" in targets else 0
            plan[name] = _Destination(f"{prefix}.gate_up_proj", expert,
                                      slice(0, half) if kind == "w1" else slice(half, 2 * half))
    _check_coverage(plan, experts, targets, source)
    with torch.no_grad():
        for name, destination in plan.items():
            value = tensors[name]
            if name in scales:
                value = dequantise(value, tensors[scales[name]], f"{source}: {name}")
            target = destination.of(targets[destination.param])
            if tuple(target.shape) != tuple(value.shape):
                raise CheckpointError(f"{source}: tensor {name} has shape {tuple(value.shape)}, the config "
                                      f"expects {tuple(target.shape)}")
            target.copy_(value)
            del value   # freed before the next tensor is read
    for name in list(mtp.values()):   # a quantised MTP weight travels with its scale
        if name in scales:
            mtp[scales[name].removeprefix("model.")] = scales[name]
    return SetAside(mtp=Renamed(tensors, mtp))


def _check_coverage(plan: dict, experts: dict, targets: dict, source: str) -> None:
    """Every parameter and buffer gets a tensor and every tensor a parameter; each layer's experts
    are 0..E-1 for w1, w3 and w2 alike."""
    covered = {destination.param for destination in plan.values()}
    missing, unexpected = sorted(set(targets) - covered), sorted(covered - set(targets))
    if missing or unexpected:
        raise CheckpointError(f"{source}: tensors do not match the deepseek_v4 layout of its config.json "
                              f"(missing {missing[:4]}, unexpected {unexpected[:4]})")
    for prefix, kinds in experts.items():
        ids = sorted(kinds.get("w2", ()))
        count = targets[f"{prefix}.down_proj"].shape[0]
        for kind in ("w1", "w3", "w2"):
            if sorted(kinds.get(kind, ())) != list(range(count)):
                raise CheckpointError(f"{source}: {prefix} has experts {ids} for w2 but "
                                      f"{sorted(kinds.get(kind, ()))} for {kind} ({count} in the config); "
                                      "the checkpoint is incomplete")
