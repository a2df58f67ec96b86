"""One place per architecture: the registry of the model families batchd runs.

Everything that differs between architectures is a field of their `Architecture` row: the names
checkpoints give them (config.json `architectures`, GGUF `general.architecture`), how a config
is read (`hf_attention_bias`, `gguf_attention_bias`), the layer's flags (q/k/v biases, q/k norm),
how GGUF tensors map back to Hugging Face ones (`gguf_permuted_qk`), and what the engine supports
for it (`capabilities`, which the feature gate in engine.capabilities enforces). The model itself
(engine.model) is one module for all of them, switched by the flags in `ModelConfig`.

Adding an architecture is adding a row here (and, for a new kind of layer, its flag in
ModelConfig and engine.model). An architecture too different for that flags its own package in
`model` (deepseek_v4: engine.deepseek_v4, whose own engine `Engine.load` returns for its
checkpoints). Rows are looked up with `architecture(name)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from batchd.engine.errors import CheckpointError


@dataclass(frozen=True)
class Capabilities:
    speculation: tuple[str, ...]  # methods besides "none"
    compression: bool  # PFlash prompt compression with a drafter (as the target)
    attention: tuple[str, ...]  # "dense", "sparse"
    devices: tuple[str, ...]
    note: str = ""
    pflash_drafter: bool = True  # can score prompts for PFlash (a drafter, or the target drafting for itself)
    # why a refused option does not apply, by option ("--attention sparse"): the refusal says it
    reasons: tuple[tuple[str, str], ...] = ()

    def reason(self, option: str) -> str:
        return dict(self.reasons).get(option, "")


def _from_config_json(cfg: dict) -> bool:
    return bool(cfg.get("attention_bias", False))


def _gguf_has_q_bias(tensor_names: set[str]) -> bool:
    return "blk.0.attn_q.bias" in tensor_names


@dataclass(frozen=True)
class Architecture:
    name: str  # ours: ModelConfig.architecture
    hf_class: str  # config.json "architectures" entry (the first is written when we save one)
    gguf_name: str  # GGUF general.architecture (its metadata keys start with it); "" if batchd reads no GGUF of it
    capabilities: Capabilities
    # the module that builds it: "transformer" (engine.model, from a ModelConfig) or its own package
    model: str = "transformer"
    attention_bias: bool = False  # q, k, v projections always carry a bias (qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before rope (qwen3)
    # llama.cpp's converter permutes q/k rows per head for its interleaved rope: undone on load
    gguf_permuted_qk: bool = False
    # config parsing hooks: whether q/k/v carry a bias when `attention_bias` does not force it
    hf_attention_bias: Callable[[dict], bool] = _from_config_json  # config.json dict -> bias?
    gguf_attention_bias: Callable[[set], bool] = _gguf_has_q_bias  # GGUF tensor names -> bias?

    def has_attention_bias_hf(self, cfg: dict) -> bool:
        return self.attention_bias or self.hf_attention_bias(cfg)

    def has_attention_bias_gguf(self, tensor_names: set[str]) -> bool:
        return self.attention_bias or self.gguf_attention_bias(tensor_names)


_ALL = ("lookup", "draft"), True, ("dense", "sparse"), ("cpu", "cuda")

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("llama", "LlamaForCausalLM", "llama",
                 Capabilities(*_ALL, "SmolLM2 and Llama 3 (llama3 rope scaling)"), gguf_permuted_qk=True),
    Architecture("qwen2", "Qwen2ForCausalLM", "qwen2",
                 Capabilities(*_ALL, "Qwen2 / Qwen2.5 (bias on q, k, v)"), attention_bias=True),
    Architecture("qwen3", "Qwen3ForCausalLM", "qwen3",
                 Capabilities(*_ALL, "Qwen3 (RMSNorm on q and k)"), qk_norm=True),
    # DeepSeek V4 (engine.deepseek_v4, docs/deepseek_v4.md), served by its own engine
    # (engine.deepseek_v4.serving.V4Engine, which Engine.load returns for a V4 folder). What this
    # build runs: prompt lookup (verify rows and rollback work for every part of its cache) and
    # draft speculation with the checkpoint's own MTP layer (engine.deepseek_v4.mtp; a checkpoint
    # without mtp.* weights refuses it); in bf16/f16 both keep greedy output through the row-invariant
    # path (engine.deepseek_v4.rows), proven on the CPU and the H200 (tests/engine/test_deepseek_v4_bf16.py).
    # PFlash with a small dense --compress-drafter beside it (its scoring is text-level; the drafter
    # stays resident, V4 is never parked for it). Never: batchd's block-sparse decode, or V4
    # scoring prompts for PFlash.
    Architecture("deepseek_v4", "DeepseekV4ForCausalLM", "", Capabilities(
        ("lookup", "draft"), True, ("dense",), ("cpu", "cuda"),
        "DeepSeek V4 (sliding window + CSA/HCA compressed attention, MoE, hyper-connections): engine.deepseek_v4, "
        "its batch engine over the scheduler and a paged pool; --spec draft drafts with the checkpoint's MTP "
        "layer (mtp.* weights)",
        pflash_drafter=False, reasons=(
            ("--spec draft", "its drafter is the checkpoint's own MTP layer (mtp.* weights), and this checkpoint "
                             "has none (the load notes say so at start); use --spec lookup"),
            ("--attention sparse", "V4 already attends sparsely (a 128-row window, the indexer's top-k of "
                                   "compressed entries); batchd's block-sparse decode does not apply"),
            ("pflash drafter", "PFlash scores prompts from dense attention rows, which V4's windowed and "
                               "compressed attention does not have; give a small dense drafter "
                               "(--compress-drafter)"))),
        model="deepseek_v4"),
)}

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
# config.json "architectures" entries -> our architecture name
HF_ARCHITECTURE_NAMES = {a.hf_class: a.name for a in ARCHITECTURES.values()}
# GGUF general.architecture -> our architecture name
GGUF_ARCHITECTURES = {a.gguf_name: a.name for a in ARCHITECTURES.values() if a.gguf_name}


def architecture(name: str) -> Architecture:
    """The registry row of `name` (ours); CheckpointError naming the supported ones if none."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise CheckpointError(f"unsupported architecture {name!r}; batchd runs "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)}") from None
