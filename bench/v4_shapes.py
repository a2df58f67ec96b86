"""DeepSeek V4 shapes for the benchmarks: V4-Flash's sizes (transformers' DeepseekV4Config defaults)
or a tiny CPU smoke shape, and a V4 model of random weights at either.

    config = v4_config(layers=4)             # V4-Flash per-layer sizes, 4 of its 43 layers
    config = v4_config(layers=2, tiny=True)  # the tests' tiny sizes, for a CPU smoke run
    model = random_v4_model(config, "cuda", torch.bfloat16)
"""
from __future__ import annotations

import torch

from batchd.engine.deepseek_v4.config import V4Config
from batchd.engine.deepseek_v4.model import DeepseekV4, build_model, parameter_bytes
from batchd.engine.residency import free_device_bytes

# the tiny sizes of tests/engine/test_deepseek_v4.py (every layer kind, 4 experts, top-2)
TINY = dict(vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=32,
            q_lora_rank=48, num_experts_per_tok=2, n_routed_experts=4, sliding_window=8, o_groups=2,
            o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=3, hc_mult=2,
            partial_rotary_factor=0.25, max_position_embeddings=512)


def flash_config_dict(tiny: bool = False) -> dict:
    """The whole model's config.json as transformers writes it (needs transformers >= 5.8)."""
    import transformers

    return transformers.DeepseekV4Config(**(TINY if tiny else {})).to_dict()


def v4_config(layers: int, tiny: bool = False) -> V4Config:
    """`layers` of the model's kinds of layer: its first (hash routing, HCA), then from its fourth on
    (learned routing, CSA and HCA alternating), so three or more show every kind."""
    full = flash_config_dict(tiny)
    total = full["num_hidden_layers"]
    if not 1 <= layers <= total - 2:
        raise ValueError(f"--v4-layers takes 1..{total - 2} layers, got {layers}")
    picked = [0, *range(3, 3 + layers - 1)]
    cfg = dict(full, num_hidden_layers=layers,
               layer_types=[full["layer_types"][i] for i in picked],
               mlp_layer_types=[full["mlp_layer_types"][i] for i in picked])
    return V4Config.from_hf_dict(cfg, source="DeepseekV4Config defaults")


@torch.no_grad()
def random_v4_model(config: V4Config, device, dtype: torch.dtype, seed: int = 0) -> DeepseekV4:
    """Random weights (speed does not depend on their values): N(0, 0.02), norms at 1, every
    hash-routed token to k distinct experts."""
    torch.manual_seed(seed)
    model = build_model(config, device, dtype)   # allocated once in its dtypes, then filled below
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0, 0.02)
    for name, buffer in model.named_buffers():
        if name.endswith("tid2eid"):
            E, k = config.num_experts, config.experts_per_token
            buffer.copy_(torch.rand(buffer.shape[0], E, device=buffer.device).argsort(dim=1)[:, :k])
        elif name.endswith("e_score_correction_bias"):
            buffer.zero_()
    return model


def layers_that_fit(device, dtype: torch.dtype, reserve_bytes: float) -> int:
    """How many V4-Flash layers fit in `device`'s free memory beside the embedding, the head and
    `reserve_bytes` (the cache, the MoE's workspace and activations): `--v4-layers fit`."""
    if torch.device(device).type != "cuda":
        raise ValueError("--v4-layers fit needs a CUDA device (it sizes the model to the GPU's free memory)")
    free = free_device_bytes(torch.device(device))
    one, two = (parameter_bytes(v4_config(n), dtype) for n in (1, 2))
    layer = two - one   # a learned-routing layer (the hash-routed first one is a little smaller)
    fixed = one - layer
    fits = int((free - fixed - reserve_bytes) // layer)
    total = flash_config_dict()["num_hidden_layers"] - 2
    if fits < 1:
        raise ValueError(f"not one V4-Flash layer ({layer / 1e9:.1f} GB) fits in {free / 1e9:.1f} GB free")
    return min(fits, total)


def layer_count(text: str) -> int | str:
    """argparse type of `--v4-layers`: a number of layers, or "fit" (as many as the GPU holds)."""
    return text if text == "fit" else int(text)


def expert_bytes(config: V4Config, element_size: int) -> int:
    """One routed (or the shared) expert's weights: gate, up [I, H] and down [H, I]."""
    return 3 * config.hidden_size * config.moe_intermediate_size * element_size
