"""`V4Config`: DeepSeek V4's hyper-parameters, read from a `deepseek_v4` config.json.

Field names follow transformers' `DeepseekV4Config` (models/deepseek_v4/configuration_deepseek_v4.py),
including its legacy spellings (`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, a flat
yarn `rope_scaling`), so the upstream checkpoint's config and one written by `save_pretrained`
read the same. Derived fields (`rope_dim`, the per-layer compression rate) are computed once here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from batchd.engine.errors import CheckpointError

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
ATTENTION_KINDS = (SLIDING, CSA, HCA)
MLP_KINDS = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
_RATIO_TO_KIND = {0: SLIDING, 4: CSA, 128: HCA}  # legacy `compress_ratios` entries


@dataclass(frozen=True)
class RopeParams:
    """One rotary family: "main" (sliding layers) or "compress" (CSA/HCA layers, their compressors
    and the indexer). yarn: `factor` and friends as transformers' yarn reads them."""

    theta: float
    rope_type: str = "default"  # "default" or "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: Optional[float] = None  # None: yarn's 0.1 ln(factor) + 1


@dataclass
class V4Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    moe_intermediate_size: int
    num_experts: int  # routed experts (n_routed_experts)
    experts_per_token: int  # num_experts_per_tok
    layer_types: list[str]
    mlp_layer_types: list[str]
    compress_rates: dict[str, int]
    rope_dim: int  # trailing channels of each head that get (interleaved) rope: qk_rope_head_dim
    rope_main: RopeParams
    rope_compress: RopeParams
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    num_nextn_predict_layers: int = 1  # MTP layers the upstream checkpoint ships (mtp.* weights)
    tie_word_embeddings: bool = False
    bos_token_id: Optional[int] = None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "deepseek_v4"

    def __post_init__(self):
        for name, kinds, allowed in (("layer_types", self.layer_types, ATTENTION_KINDS),
                                     ("mlp_layer_types", self.mlp_layer_types, MLP_KINDS)):
            if len(kinds) != self.num_layers:
                raise CheckpointError(f"{name} has {len(kinds)} entries for {self.num_layers} layers; "
                                      "give one per layer")
            bad = sorted(set(kinds) - set(allowed))
            if bad:
                raise CheckpointError(f"{name} entries {bad} are not DeepSeek V4 layer kinds ({', '.join(allowed)})")
        if self.scoring_func not in SCORING_FUNCS:
            raise CheckpointError(f"scoring_func {self.scoring_func!r} is not one of {', '.join(SCORING_FUNCS)}")
        if self.num_heads * self.head_dim % self.o_groups:
            raise CheckpointError(f"o_groups {self.o_groups} does not divide {self.num_heads} heads x {self.head_dim}")
        if self.rope_dim % 2 or not 0 < self.rope_dim <= min(self.head_dim, self.index_head_dim):
            raise CheckpointError(f"rope dim {self.rope_dim} must be even and at most head_dim {self.head_dim} "
                                  f"and index_head_dim {self.index_head_dim}")

    def compress_rate(self, layer: int) -> int:
        """Source tokens per compressed entry of `layer` (0: a sliding-window-only layer)."""
        kind = self.layer_types[layer]
        return 0 if kind == SLIDING else int(self.compress_rates[kind])

    @classmethod
    def from_hf_dict(cls, cfg: dict, source: str = "config.json") -> "V4Config":
        """config.json (a dict) -> V4Config; CheckpointError naming `source` for what is missing."""
        try:
            n = int(cfg["num_hidden_layers"])
            head_dim = int(cfg.get("head_dim") or 512)
            rope_dim = _rope_dim(cfg, head_dim)
            main, compress = _rope_families(cfg)
            eos = cfg.get("eos_token_id", 1)
            return cls(
                vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], num_layers=n,
                num_heads=cfg["num_attention_heads"], head_dim=head_dim, q_lora_rank=cfg["q_lora_rank"],
                moe_intermediate_size=cfg["moe_intermediate_size"], num_experts=cfg["n_routed_experts"],
                experts_per_token=cfg["num_experts_per_tok"], layer_types=_layer_types(cfg, n),
                mlp_layer_types=_mlp_layer_types(cfg, n), compress_rates=_compress_rates(cfg), rope_dim=rope_dim,
                rope_main=main, rope_compress=compress, sliding_window=cfg.get("sliding_window", 128),
                o_groups=cfg.get("o_groups", 8), o_lora_rank=cfg.get("o_lora_rank", 1024),
                index_n_heads=cfg.get("index_n_heads", 64), index_head_dim=cfg.get("index_head_dim", 128),
                index_topk=cfg.get("index_topk", 512), hc_mult=cfg.get("hc_mult", 4),
                hc_sinkhorn_iters=cfg.get("hc_sinkhorn_iters", 20), hc_eps=cfg.get("hc_eps", 1e-6),
                scoring_func=cfg.get("scoring_func", "sqrtsoftplus"),
                routed_scaling_factor=cfg.get("routed_scaling_factor", 1.5),
                swiglu_limit=cfg.get("swiglu_limit", 10.0), rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                max_position_embeddings=cfg.get("max_position_embeddings", 1048576),
                num_nextn_predict_layers=cfg.get("num_nextn_predict_layers", 1),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                bos_token_id=cfg.get("bos_token_id", 0),
                eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            )
        except KeyError as missing:
            raise CheckpointError(f"{source}: missing required key {missing} for deepseek_v4") from None
        except CheckpointError as err:
            raise CheckpointError(f"{source}: {err}") from None


def _rope_dim(cfg: dict, head_dim: int) -> int:
    if cfg.get("qk_rope_head_dim"):
        return int(cfg["qk_rope_head_dim"])
    factor = cfg.get("partial_rotary_factor") or 64 / 512
    return int(head_dim * factor)


def _layer_types(cfg: dict, n: int) -> list[str]:
    # as transformers: explicit > legacy per-layer ratios (0/4/128) > 2 HCA then CSA/HCA alternating
    if cfg.get("layer_types"):
        return list(cfg["layer_types"][:n])
    if cfg.get("compress_ratios") is not None:
        try:
            return [_RATIO_TO_KIND[int(r)] for r in cfg["compress_ratios"][:n]]
        except KeyError as bad:
            raise CheckpointError(f"compress_ratios entry {bad} is not 0, 4 or 128") from None
    interleave = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    return [HCA] * min(n, 2) + interleave


def _mlp_layer_types(cfg: dict, n: int) -> list[str]:
    if cfg.get("mlp_layer_types"):
        return list(cfg["mlp_layer_types"][:n])
    n_hash = cfg.get("num_hash_layers", 3)
    return ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)


def _compress_rates(cfg: dict) -> dict[str, int]:
    rates = dict(cfg.get("compress_rates") or {CSA: 4, HCA: 128})
    if cfg.get("compress_rate_csa") is not None:
        rates[CSA] = cfg["compress_rate_csa"]
    if cfg.get("compress_rate_hca") is not None:
        rates[HCA] = cfg["compress_rate_hca"]
    return rates


def _rope_families(cfg: dict) -> tuple[RopeParams, RopeParams]:
    """("main", "compress") as transformers' __post_init__ builds them: a nested rope_parameters is
    read as it is; otherwise the main family is plain rope at rope_theta, and the compress family
    is compress_rope_theta with the flat rope_scaling / rope_parameters (yarn, attention_factor 1)."""
    nested = cfg.get("rope_parameters") or {}
    if isinstance(nested.get("main"), dict) and isinstance(nested.get("compress"), dict):
        return _rope_params(nested["main"]), _rope_params(nested["compress"])
    flat = {k: v for k, v in (cfg.get("rope_scaling") or nested or {}).items() if k not in ("main", "compress")}
    main = RopeParams(theta=float(cfg.get("rope_theta") or 10000.0))
    compress = dict(flat, rope_theta=float(cfg.get("compress_rope_theta") or 160000.0))
    kind = compress.get("rope_type") or compress.get("type") or "default"
    if kind == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return main, _rope_params(dict(compress, rope_type=kind))


def _rope_params(params: dict) -> RopeParams:
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ("default", "yarn"):
        raise CheckpointError(f"rope type {kind!r} is not supported for deepseek_v4 (default or yarn)")
    if kind == "default":
        return RopeParams(theta=float(params["rope_theta"]))
    return RopeParams(theta=float(params["rope_theta"]), rope_type="yarn", factor=float(params["factor"]),
                      original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                      beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                      attention_factor=params.get("attention_factor"))
