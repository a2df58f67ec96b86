"""The real SmolLM2-135M-Instruct Q4_1 GGUF (../shared/MODELS.md): loads with the right config, tensors that equal the `gguf` package's and transformers' readings of the same file, and
a tokenizer that matches the one the model was trained with."""
from __future__ import annotations

import gguf
import jinja2
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from batchd.engine.checkpoint import load_checkpoint
from batchd.engine.checkpoint.gguf_file import hf_name, read_gguf

SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


@pytest.fixture(scope="module")
def ckpt(smollm2_gguf):
    return load_checkpoint(smollm2_gguf)   # how long it takes is bench/checkpoint_load.py's, not a test's


@pytest.fixture(scope="module")
def reader(smollm2_gguf):
    return gguf.GGUFReader(smollm2_gguf)


def test_config_matches_models_md(ckpt):
    c = ckpt.config
    assert c.architecture == "llama"
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (30, 576, 9, 3)
    assert (c.head_dim, c.intermediate_size, c.vocab_size) == (64, 1536, 49152)
    assert c.tie_word_embeddings and "lm_head.weight" not in ckpt.tensors
    assert c.rope_theta == 100000.0 and c.rope_scaling is None
    assert c.rms_norm_eps == 1e-5 and c.max_position_embeddings == 8192
    assert c.bos_token_id == 1 and c.eos_token_ids == [2]
    assert not c.attention_bias and not c.qk_norm


def test_file_identity(ckpt, smollm2_gguf):
    assert ckpt.format == "gguf" and ckpt.path == str(smollm2_gguf)
    assert ckpt.sha256 == SMOLLM2_SHA256
    assert ckpt.weight_bytes == 98_362_432


def test_header_parse_equals_gguf_reader(smollm2_gguf, reader):
    ours = read_gguf(smollm2_gguf)
    assert [(t.name, t.qtype, t.shape, t.offset) for t in ours.tensors] == [
        (t.name, int(t.tensor_type), tuple(int(d) for d in reversed(t.shape)), int(t.data_offset))
        for t in reader.tensors]
    theirs = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata.keys() == theirs.keys()
    for key, value in theirs.items():
        if isinstance(value, float):
            assert np.float32(ours.metadata[key]) == np.float32(value), key
        else:
            assert ours.metadata[key] == value, key


def test_quant_types_present_are_the_expected_ones(reader):
    assert {t.tensor_type for t in reader.tensors} == {QT.Q4_1, QT.Q8_0, QT.F32}


def test_dequantised_tensors_equal_the_gguf_reference(ckpt, reader):
    # every F32 and Q8_0 tensor, and the Q4_1 tensors of three layers (all 210 take the reference ~5 s)
    checked = set()
    for t in reader.tensors:
        layer = t.name.split(".")[1] if t.name.startswith("blk.") else None
        if t.tensor_type == QT.Q4_1 and layer not in ("0", "14", "29"):
            continue
        if t.name.endswith(("attn_q.weight", "attn_k.weight")):
            continue  # permuted: compared in the next test
        reference = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
        assert torch.equal(ckpt.tensors[hf_name(t.name)], reference), t.name
        checked.add(t.tensor_type)
    assert checked == {QT.Q4_1, QT.Q8_0, QT.F32}


def test_q_and_k_equal_transformers_reverse_permutation(ckpt, reader):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    for t in reader.tensors:
        if t.name.startswith(("blk.0.", "blk.29.")) and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            weights = gguf.quants.dequantize(t.data, t.tensor_type)
            expected = processor.process(weights=weights, name=t.name).weights
            assert torch.equal(ckpt.tensors[hf_name(t.name)], torch.from_numpy(np.array(expected))), t.name


def test_tokenizer_round_trips_real_text(ckpt, aclsum_sample):
    for paper in aclsum_sample:
        ids = ckpt.tokenizer.encode(paper.text).ids
        assert len(ids) > 1000
        assert ckpt.tokenizer.decode(ids) == paper.text


# ids verified by decoding each one (digits split one by one, as MODELS.md says)
KNOWN_IDS = {
    "The capital of France is": [504, 3575, 282, 4649, 314],
    "Hello world! 123": [19556, 905, 17, 216, 33, 34, 35],
    "Café déjà vu.": [51, 1939, 2756, 32564, 90, 16739, 386, 101, 30],
    "  multiple   spaces": [216, 2701, 256, 5600],
    "<|im_start|>user\nHi<|im_end|>": [1, 4093, 198, 26843, 2],
}


@pytest.mark.parametrize("text", list(KNOWN_IDS))
def test_tokenizer_known_ids(ckpt, text):
    ids = KNOWN_IDS[text]
    assert ckpt.tokenizer.encode(text).ids == ids
    assert "".join(ckpt.tokenizer.decode([i], skip_special_tokens=False) for i in ids) == text


def test_digits_are_isolated_before_the_byte_level_split(ckpt):
    # llama.cpp's "smollm" pre-tokenizer (and SmolLM2's own tokenizer.json: Digits, then ByteLevel)
    # isolate digits first, so "\n\n" before a digit stays one token (1116), not two (198, 198)
    assert ckpt.tokenizer.encode(".\n\n1. We").ids == [30, 1116, 33, 30, 1046]


def test_tokenizer_matches_transformers_gguf_conversion(ckpt, smollm2_gguf, aclsum_sample):
    convert = pytest.importorskip("transformers.integrations.gguf")
    from tokenizers import pre_tokenizers

    architecture, tokenizer_dict, _ = convert.get_gguf_tokenizer(str(smollm2_gguf))
    theirs, _ = convert.convert_gguf_tokenizer(architecture, tokenizer_dict)
    # transformers maps "smollm" to plain ByteLevel, dropping the digit split (previous test);
    # with it restored, vocabulary, merges and special tokens must give identical ids
    theirs.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                    theirs.pre_tokenizer])
    texts = [p.text for p in aclsum_sample] + list(KNOWN_IDS) + ["x1.5e10, ٣٤٥ ²³ <|im_end|>"]
    for text in texts:
        assert ckpt.tokenizer.encode(text).ids == theirs.encode(text).ids, text[:80]


def test_special_tokens_and_chat_template(ckpt):
    assert (ckpt.bos_token, ckpt.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert ckpt.special_token_ids == set(range(17))
    prompt = jinja2.Template(ckpt.chat_template).render(
        messages=[{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert ckpt.tokenizer.decode(ckpt.tokenizer.encode(prompt).ids, skip_special_tokens=True).startswith("system\n")


@pytest.mark.slow
def test_every_tensor_equals_transformers_gguf_loader(ckpt, transformers_smollm2):
    """transformers' own GGUF loader (its reverse permutation, names and dequantisation) on the same
    file: the float32 model `from_pretrained(gguf_file=...)` builds (loaded once for the session)."""
    model, _ = transformers_smollm2
    theirs = dict(model.state_dict())
    theirs.pop("lm_head.weight", None)           # tied to the embedding
    assert theirs.keys() == ckpt.tensors.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ckpt.tensors[name], tensor.float()), name
