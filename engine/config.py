"""Model hyper-parameters, read from a Hugging Face config.json or from GGUF metadata.

One `ModelConfig` describes every supported architecture; the differences between them are
flags (`attention_bias`, `qk_norm`) rather than subclasses, set from the architecture's row in
engine.architectures (the one place that names architectures).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from batchd.engine.architectures import HF_ARCHITECTURE_NAMES, SUPPORTED_ARCHITECTURES, architecture
from batchd.engine.errors import BadInputError, CheckpointError

__all__ = ["ConfigValueError", "DTYPES", "ModelConfig", "parse_dtype", "HF_ARCHITECTURE_NAMES", "SUPPORTED_ARCHITECTURES"]

# Field -> the Hugging Face config.json key it comes from, where the names differ (the GGUF
# loader has its own map): errors name the key a person can find in their file.
HF_KEYS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
           "num_kv_heads": "num_key_value_heads"}


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "f16": torch.float16}


def parse_dtype(name: Optional[str], device: str) -> torch.dtype:
    if name is None:
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise BadInputError(f"unknown dtype {name!r}; use one of {', '.join(sorted(DTYPES))}") from None


class ConfigValueError(CheckpointError):
    """A config value no model can have (NaN, zero, negative, a string, heads that do not divide).

    `field` is the ModelConfig field; the loaders name the key of their own file
    (`describe(key)`), so the message points at what to fix.
    """

    def __init__(self, field: str, value: Any, requirement: str):
        self.field, self.value, self.requirement = field, value, requirement
        super().__init__(self.describe(field))

    def describe(self, key: str) -> str:
        return f"{key} is {short_repr(self.value)}, but {self.requirement}"


def short_repr(value: Any, limit: int = 60) -> str:
    """A value read from a file, for a one-line message: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # HF dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k, v projections (qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before rope (qwen3)
    bos_token_id: Optional[int] = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"unsupported architecture {self.architecture!r}; batchd runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if architecture(self.architecture).model != "transformer":
            raise CheckpointError(f"{self.architecture} has its own model package "
                                  f"(engine.{architecture(self.architecture).model}), not ModelConfig")
        self._check_values()
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        if self.head_dim % 2:
            raise ConfigValueError("head_dim", self.head_dim, "rope rotates pairs of channels, so it must be even")

    def _check_values(self) -> None:
        """Refuse what no model has before anything is sized from it: a NaN rope base would load
        and generate garbage, a context length of 0 would serve and fail every job."""
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                     "max_position_embeddings"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("head_dim", self.head_dim, minimum=0)
        _check_float("rms_norm_eps", self.rms_norm_eps, "a finite number in (0, 1)", lambda v: 0 < v < 1)
        _check_float("rope_theta", self.rope_theta, "a finite number > 0", lambda v: v > 0)
        if self.num_heads % self.num_kv_heads:
            raise ConfigValueError("num_kv_heads", self.num_kv_heads,
                                   f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim == 0 and self.hidden_size % self.num_heads:
            raise ConfigValueError("num_heads", self.num_heads,
                                   f"it must divide hidden_size {self.hidden_size} (or give head_dim)")
        check_rope_scaling(self.rope_scaling)

    @property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, cfg: dict, source: str = "config.json") -> "ModelConfig":
        arch = cfg.get("model_type")
        for name in cfg.get("architectures") or []:
            arch = HF_ARCHITECTURE_NAMES.get(name, arch)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"{source}: unsupported architecture {arch!r} "
                f"(architectures={cfg.get('architectures')}); batchd runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        row = architecture(arch)
        if row.model != "transformer":  # e.g. a V4 checkpoint named as a drafter
            raise CheckpointError(f"{source}: {arch} has its own model (engine.{row.model}): Engine.load serves "
                                  "its folder as a target; it cannot be a drafter")
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        try:
            return cls(
                architecture=arch,
                vocab_size=cfg["vocab_size"],
                hidden_size=cfg["hidden_size"],
                num_layers=cfg["num_hidden_layers"],
                num_heads=cfg["num_attention_heads"],
                num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                intermediate_size=cfg["intermediate_size"],
                head_dim=cfg.get("head_dim") or 0,
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
                rope_theta=_rope_theta(cfg),
                rope_scaling=_rope_scaling(cfg),
                max_position_embeddings=cfg.get("max_position_embeddings", 4096),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=row.has_attention_bias_hf(cfg),
                qk_norm=row.qk_norm,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as missing:
            raise CheckpointError(f"{source}: missing required key {missing}") from None
        except ConfigValueError as err:
            key = HF_KEYS.get(err.field, err.field)
            raise CheckpointError(f"{source}: {err.describe(key)}; fix the config") from None


def check_rope_scaling(scaling: Optional[dict]) -> None:
    if scaling and "factor" in scaling:
        _check_float("rope_scaling.factor", scaling["factor"], "a finite number > 0", lambda v: v > 0)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigValueError(name, value, f"it must be a whole number >= {minimum}")


def _check_float(name: str, value: Any, requirement: str, in_range) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or not in_range(value):
        raise ConfigValueError(name, value, f"it must be {requirement}")


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(cfg: dict) -> Optional[dict]:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    return dict(scaling, rope_type=kind)
