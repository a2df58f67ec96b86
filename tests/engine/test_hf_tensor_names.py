"""engine.model.unfuse_hf_tensors is the inverse of fuse_hf_tensors."""
from __future__ import annotations

import pytest
import torch

from batchd.engine.config import ModelConfig
from batchd.engine.model import Transformer, fuse_hf_tensors, unfuse_hf_tensors
from tests.engine.tiny_models import hf_model


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "llama-tied"])
def test_unfuse_round_trips_hf_tensors(name):
    model = hf_model(name)
    hf = dict(model.state_dict())
    config = ModelConfig.from_hf_dict(model.config.to_dict())
    if config.tie_word_embeddings:
        hf.pop("lm_head.weight")  # HF checkpoints of tied models do not store it
    back = unfuse_hf_tensors(fuse_hf_tensors(hf, config), config)
    assert sorted(back) == sorted(hf)
    for key, value in hf.items():
        assert torch.equal(back[key], value), key


def test_unfused_model_state_loads_into_a_fresh_model():
    model = hf_model("qwen2")
    config = ModelConfig.from_hf_dict(model.config.to_dict())
    ours = Transformer(config)
    ours.load_hf_tensors(dict(model.state_dict()))
    again = Transformer(config)
    again.load_hf_tensors(unfuse_hf_tensors(dict(ours.state_dict()), config))
    for (key, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), key
