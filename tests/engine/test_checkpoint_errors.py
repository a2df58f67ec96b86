"""Every way a checkpoint can be wrong gives a one-line CheckpointError that names the file and
says what to do; none gives a traceback from deep inside a library."""
from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from safetensors.torch import load_file, save_file

from batchd.engine.checkpoint import load_checkpoint
from batchd.engine.errors import CheckpointError
from tests.engine.test_checkpoint_builders import tiny_hf_model, tiny_tokenizer, write_gguf, write_hf_folder


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_hf_model("llama", tokenizer.get_vocab_size())


@pytest.fixture(scope="module")
def pristine_folder(tmp_path_factory, model, tokenizer) -> Path:
    return write_hf_folder(tmp_path_factory.mktemp("hf"), model, tokenizer)


@pytest.fixture(scope="module")
def pristine_sharded(tmp_path_factory, model, tokenizer) -> Path:
    return write_hf_folder(tmp_path_factory.mktemp("sharded"), model, tokenizer, max_shard_size="60KB")


@pytest.fixture(scope="module")
def pristine_gguf(tmp_path_factory, model, tokenizer) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", model, tokenizer, qtype=QT.Q8_0)


@pytest.fixture
def folder(tmp_path, pristine_folder) -> Path:
    return Path(shutil.copytree(pristine_folder, tmp_path / "model"))


@pytest.fixture
def gguf_copy(tmp_path, pristine_gguf) -> Path:
    return Path(shutil.copy(pristine_gguf, tmp_path / "model.gguf"))


def load_error(path: Path, *fragments: str, names: Path | None = None) -> str:
    """Load `path`; expect a one-line CheckpointError naming `names` (default: `path`) and matching
    each regex in `fragments`."""
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    named = str(names or path)
    assert message.startswith(f"{named}: "), message
    assert "\n" not in message, message
    assert info.value.kind == "model_error"
    for fragment in fragments:  # searched after the path, which holds the test's name
        assert re.search(fragment, message[len(named):]), f"{fragment!r} not in {message!r}"
    return message


def truncate(path: Path, keep: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:len(data) + keep])


# ---- paths and formats -------------------------------------------------------------------

def test_missing_path(tmp_path):
    load_error(tmp_path / "nowhere", "no such file or folder")


def test_file_that_is_neither_gguf_nor_folder(folder):
    load_error(folder / "config.json", "not a GGUF file", "folder")


def test_gguf_suffix_without_gguf_magic(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"<html>404 not found</html>" * 10)
    load_error(path, "not a GGUF file")


# ---- Hugging Face folders ------------------------------------------------------------------

def test_missing_config_json(folder):
    (folder / "config.json").unlink()
    load_error(folder, "missing", "needs config.json", names=folder / "config.json")


def test_config_json_that_is_not_json(folder):
    (folder / "config.json").write_text("{ not json")
    load_error(folder, "JSON", names=folder / "config.json")


def test_unknown_architecture(folder):
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (folder / "config.json").write_text(json.dumps(config))
    load_error(folder, "unsupported architecture 'gpt2'", names=folder / "config.json")


def test_config_missing_a_required_key(folder):
    config = json.loads((folder / "config.json").read_text())
    del config["hidden_size"]
    (folder / "config.json").write_text(json.dumps(config))
    load_error(folder, "hidden_size", names=folder / "config.json")


def test_missing_weights(folder):
    (folder / "model.safetensors").unlink()
    load_error(folder, "missing", names=folder / "model.safetensors")


def test_pickled_weights_are_refused(folder):
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    load_error(folder, "pytorch_model.bin", "safetensors only")


def test_missing_tokenizer_json(folder):
    (folder / "tokenizer.json").unlink()
    load_error(folder, "missing", names=folder / "tokenizer.json")


def test_corrupt_tokenizer_json(folder):
    (folder / "tokenizer.json").write_text('{"model": {"type": "Nonsense"}}')
    load_error(folder, "cannot be loaded", names=folder / "tokenizer.json")


@pytest.mark.parametrize("keep", [-1000, 4, 100], ids=["data", "length", "header"])
def test_truncated_safetensors(folder, keep):
    truncate(folder / "model.safetensors", keep)
    load_error(folder, "cut short|corrupt", names=folder / "model.safetensors")


def test_garbage_safetensors(folder):
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 12) + b"not a header" + bytes(64))
    load_error(folder, "corrupt", names=folder / "model.safetensors")


def test_shape_that_disagrees_with_the_config(folder):
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(config))
    load_error(folder, r"mlp\.\w+_proj\.weight has shape \[", r"implies \[", names=folder / "model.safetensors")


def _rewrite_weights(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


def test_missing_tensor(folder):
    _rewrite_weights(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    load_error(folder, r"missing tensors model\.layers\.1\.mlp\.up_proj\.weight", names=folder / "model.safetensors")


def test_unexpected_tensor(folder):
    _rewrite_weights(folder, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2, 2)}))
    load_error(folder, r"unexpected tensors model\.layers\.0\.mlp\.extra\.weight", names=folder / "model.safetensors")


def test_missing_shard(tmp_path, pristine_sharded):
    folder = Path(shutil.copytree(pristine_sharded, tmp_path / "model"))
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    load_error(folder, "shard", "missing", names=shard)


def test_truncated_shard(tmp_path, pristine_sharded):
    folder = Path(shutil.copytree(pristine_sharded, tmp_path / "model"))
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    truncate(shard, -100)
    load_error(folder, "cut short", names=shard)


# ---- GGUF files ------------------------------------------------------------------------------

@pytest.mark.parametrize("keep", [-100, 3000, 30], ids=["data", "metadata", "counts"])
def test_truncated_gguf(gguf_copy, keep):
    truncate(gguf_copy, keep)
    load_error(gguf_copy, "cut short|too short", "download it again")


def test_gguf_unknown_architecture(tmp_path, model, tokenizer):
    path = write_gguf(tmp_path / "gpt2.gguf", model, tokenizer, arch="gpt2")
    load_error(path, "unsupported architecture 'gpt2'")


def test_gguf_unsupported_quant_type_is_named(tmp_path, model, tokenizer):
    # Q2_K needs 256-weight rows: the down projection of a model with intermediate 256 has them
    wide = tiny_hf_model("llama", tokenizer.get_vocab_size(), intermediate_size=256)
    path = write_gguf(tmp_path / "q2k.gguf", wide, tokenizer, tensor_types={"blk.0.ffn_down.weight": QT.Q2_K})
    load_error(path, "blk.0.ffn_down.weight", "Q2_K", "re-quantise")


def test_gguf_unknown_type_id_is_named(gguf_copy):
    data = bytearray(gguf_copy.read_bytes())
    name = b"blk.0.ffn_down.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 250)  # the type field
    gguf_copy.write_bytes(bytes(data))
    load_error(gguf_copy, "blk.0.ffn_down.weight", "unknown GGUF type id 250")


def test_gguf_shape_that_disagrees_with_the_metadata(tmp_path, model, tokenizer):
    path = write_gguf(tmp_path / "m.gguf", model, tokenizer, metadata={"llama.feed_forward_length": 96})
    load_error(path, r"blk\.0\.ffn_\w+\.weight has shape", "implies")


def test_gguf_missing_tensor(tmp_path, model, tokenizer):
    path = write_gguf(tmp_path / "m.gguf", model, tokenizer, drop=("blk.1.attn_v.weight",))
    load_error(path, r"missing tensors model\.layers\.1\.self_attn\.v_proj\.weight")


def test_gguf_metadata_of_another_layer_count(tmp_path, model, tokenizer):
    path = write_gguf(tmp_path / "m.gguf", model, tokenizer, metadata={"llama.block_count": 1})
    load_error(path, r"unexpected tensors blk\.1\.")


def test_gguf_sentencepiece_vocabulary_is_refused(tmp_path, model, tokenizer):
    path = write_gguf(tmp_path / "m.gguf", model, tokenizer, tokenizer_model="llama")
    load_error(path, "tokenizer model 'llama'", "Hugging Face folder")


def test_gguf_unknown_pre_tokenizer(tmp_path, model, tokenizer):
    path = write_gguf(tmp_path / "m.gguf", model, tokenizer, pre="klingon")
    load_error(path, "pre-tokenizer 'klingon'")


def test_gguf_split_part_is_refused(tmp_path, model, tokenizer):
    path = write_gguf(tmp_path / "m-00001-of-00002.gguf", model, tokenizer, metadata={"split.count": 2})
    load_error(path, "split GGUF", "merge")


def test_gguf_wrong_version(gguf_copy):
    data = bytearray(gguf_copy.read_bytes())
    struct.pack_into("<I", data, 4, 1)
    gguf_copy.write_bytes(bytes(data))
    load_error(gguf_copy, "GGUF version 1")


def test_head_counts_that_cannot_be_right(folder, tmp_path, model, tokenizer):
    config = json.loads((folder / "config.json").read_text())
    config["num_key_value_heads"] = 3  # 4 query heads cannot share 3 KV heads
    (folder / "config.json").write_text(json.dumps(config))
    load_error(folder, "num_heads 4 is not a multiple of num_kv_heads 3", names=folder / "config.json")
    path = write_gguf(tmp_path / "m.gguf", model, tokenizer, metadata={"llama.attention.head_count_kv": 3})
    load_error(path, "num_kv_heads 3", "inconsistent")


# ---- hostile files (issue 38, item 4): every size in a header is bounded by the file before
# anything is allocated or looped over, and every config value is checked -----------------------

def _patch_u64_after(path: Path, marker: bytes, skip: int, value: int) -> None:
    """Overwrite the u64 found `skip` bytes after the first `marker` in the file."""
    data = bytearray(path.read_bytes())
    struct.pack_into("<Q", data, data.index(marker) + len(marker) + skip, value)
    path.write_bytes(bytes(data))


def _with_key_value(path: Path, raw_kv: bytes) -> None:
    """Insert one raw metadata item (key, type, value) first and count it in the header."""
    data = bytearray(path.read_bytes())
    (n_kv,) = struct.unpack_from("<Q", data, 16)
    struct.pack_into("<Q", data, 16, n_kv + 1)
    path.write_bytes(bytes(data[:24]) + raw_kv + bytes(data[24:]))


def _gguf_string(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


@pytest.mark.parametrize("metadata, fragments", [
    ({"llama.block_count": 10**9}, ["metadata llama.block_count is 1000000000", "holds only 21 tensors"]),
    ({"general.alignment": 0}, ["metadata general.alignment is 0", "power of two"]),
    ({"general.alignment": 48}, ["metadata general.alignment is 48", "power of two"]),
    ({"llama.rope.freq_base": float("nan")}, ["metadata llama.rope.freq_base is nan", "finite number > 0"]),
    ({"llama.rope.freq_base": float("inf")}, ["metadata llama.rope.freq_base is inf", "finite number > 0"]),
    ({"llama.context_length": 0}, ["metadata llama.context_length is 0", "whole number >= 1"]),
    ({"llama.attention.layer_norm_rms_epsilon": -1.0}, ["layer_norm_rms_epsilon is -1.0", r"in \(0, 1\)"]),
    ({"llama.attention.head_count": 0}, ["metadata llama.attention.head_count is 0", "whole number >= 1"]),
    ({"llama.attention.head_count": 3, "llama.attention.head_count_kv": 3},
     ["metadata llama.attention.head_count is 3", "must divide hidden_size 64"]),
    ({"llama.embedding_length": "wide"}, ["metadata llama.embedding_length is 'wide'", "whole number"]),
    ({"llama.rope.scaling.type": "linear"}, ["metadata llama.rope.scaling.factor is None", "finite number > 0"]),
], ids=["block-count-1e9", "alignment-0", "alignment-48", "freq-base-nan", "freq-base-inf", "context-0",
        "negative-eps", "no-heads", "heads-not-dividing", "string-size", "scaling-without-factor"])
def test_gguf_hostile_metadata_value(tmp_path, model, tokenizer, metadata, fragments):
    path = write_gguf(tmp_path / "hostile.gguf", model, tokenizer, qtype=QT.Q8_0, metadata=metadata)
    load_error(path, *fragments)


HUGE = 1 << 60


@pytest.mark.parametrize("patch, fragments", [
    (lambda p: _patch_u64_after(p, b"GGUF", 4, HUGE), ["tensor count 1152921504606846976", "download it again"]),
    (lambda p: _patch_u64_after(p, b"GGUF", 12, HUGE), ["metadata count 1152921504606846976"]),
    (lambda p: _patch_u64_after(p, b"GGUF", 20, HUGE), ["cut short or corrupt while reading a metadata key"]),
    (lambda p: _patch_u64_after(p, _gguf_string("tokenizer.ggml.tokens"), 8, HUGE),
     ["reading metadata 'tokenizer.ggml.tokens'"]),
    (lambda p: _patch_u64_after(p, _gguf_string("tokenizer.ggml.merges"), 8, HUGE // 8),
     ["reading metadata 'tokenizer.ggml.merges'"]),
    (lambda p: _patch_u64_after(p, _gguf_string("general.architecture"), 4, HUGE),
     ["reading metadata 'general.architecture'"]),
    (lambda p: _patch_u64_after(p, _gguf_string("blk.0.ffn_down.weight"), 4, 1 << 40),
     ["tensor 'blk.0.ffn_down.weight' needs bytes", "cut short"]),
    (lambda p: _with_key_value(p, _gguf_string("nested") + struct.pack("<IIQ", 9, 9, HUGE)),
     ["reading metadata 'nested'"]),
], ids=["tensor-count", "kv-count", "key-length", "array-length", "string-array-length", "string-length",
        "tensor-dims", "array-of-arrays-length"])
def test_gguf_absurd_header_sizes_fail_before_allocating(gguf_copy, patch, fragments):
    patch(gguf_copy)
    load_error(gguf_copy, *fragments)


def test_gguf_arrays_nested_20000_deep(gguf_copy):
    depth = 20_000
    nested = struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * (depth - 1) + struct.pack("<IQ", 4, 0)
    _with_key_value(gguf_copy, _gguf_string("deep") + nested)
    load_error(gguf_copy, "metadata 'deep' nests arrays more than 8 deep")


def test_hf_config_hostile_values(folder):
    for key, value, fragment in [("rope_theta", float("nan"), "rope_theta is nan"),
                                 ("max_position_embeddings", 0, "max_position_embeddings is 0"),
                                 ("num_hidden_layers", 10**9, "num_hidden_layers is 1000000000, but the file holds"),
                                 ("rms_norm_eps", 0.0, "rms_norm_eps is 0.0")]:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, key: value}))
        load_error(folder, fragment, names=folder / "config.json")
        (folder / "config.json").write_text(json.dumps(config))


SANDBOX_ESCAPE = "{{ messages.__class__.__mro__[1].__subclasses__() }}"


def test_chat_template_the_sandbox_blocks_is_a_model_error(tmp_path, model, tokenizer):
    from batchd.engine.errors import BadInputError
    from batchd.engine.text import TextCodec

    path = write_gguf(tmp_path / "escape.gguf", model, tokenizer, metadata={"tokenizer.chat_template": SANDBOX_ESCAPE})
    ckpt = load_checkpoint(path)
    codec = TextCodec(ckpt.tokenizer, ckpt.chat_template, template_source=ckpt.chat_template_source)
    with pytest.raises(CheckpointError) as info:
        codec.encode_request(None, [{"role": "user", "content": "hi"}], chat=True)
    message = str(info.value)
    assert message.startswith(f"{path}: metadata tokenizer.chat_template: the Jinja sandbox blocks"), message
    assert "\n" not in message and info.value.kind == "model_error"
    refusing = TextCodec(ckpt.tokenizer, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(BadInputError, match="the chat template refuses these messages: roles must alternate"):
        refusing.encode_request("hi", None, chat=True)
    with pytest.raises(CheckpointError, match=r"x.json: chat_template: the chat template is not valid Jinja \(line 1"):
        TextCodec(ckpt.tokenizer, "{% for %}", template_source="x.json: chat_template")
