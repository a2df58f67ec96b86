"""The tensors a config implies, and a check that a checkpoint has exactly those, with those shapes.

Shapes are checked from the file headers before any data is read, so a wrong file fails fast.
"""
from __future__ import annotations

from batchd.engine.config import ModelConfig
from batchd.engine.errors import CheckpointError

# Names some HF checkpoints carry that are not weights; dropped without comment.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for every tensor the model needs."""
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * d, config.num_kv_heads * d
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        layer = {
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q, h),
            "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q),
            "mlp.gate_proj.weight": (inter, h),
            "mlp.up_proj.weight": (inter, h),
            "mlp.down_proj.weight": (h, inter),
        }
        if config.attention_bias:
            layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                          "self_attn.v_proj.bias": (kv,)})
        if config.qk_norm:
            layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer.items()})
    return shapes


def check_layer_count(config: ModelConfig, n_tensors: int, source: str, key: str) -> None:
    """Refuse a layer count the file cannot hold (each layer has several tensors) before
    `expected_shapes` loops over it. `key`: where the count came from, for the message."""
    if config.num_layers > n_tensors:
        raise CheckpointError(f"{source}: {key} is {config.num_layers}, but the file holds only {n_tensors} tensors; "
                              f"the file's metadata is corrupt or belongs to another model")


def check_tensor_shapes(found: dict[str, tuple[int, ...]], config: ModelConfig, source: str,
                        source_names: dict[str, str] | None = None) -> None:
    """Raise CheckpointError naming `source` if tensors are missing, unexpected or of the wrong shape.

    found: HF name -> shape as stored. source_names: HF name -> the file's own name, for messages.
    """
    source_names = source_names or {}
    expected = expected_shapes(config)
    shown = lambda name: source_names.get(name, name)  # noqa: E731
    missing = [name for name in expected if name not in found]
    unexpected = [shown(name) for name in found if name not in expected]
    if missing:
        raise CheckpointError(f"{source}: missing tensors {_some(missing)} for a {config.num_layers}-layer "
                              f"{config.architecture} model; the checkpoint is incomplete or of another model")
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensors {_some(unexpected)}; batchd does not know how "
                              f"to use them (a different architecture or a config that does not match?)")
    for name, shape in expected.items():
        if tuple(found[name]) != shape:
            raise CheckpointError(
                f"{source}: tensor {shown(name)} has shape {list(found[name])}, but the config implies "
                f"{list(shape)}; the weights and the config do not belong together")


def _some(names: list[str], limit: int = 4) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
