"""engine.deepseek_v4 against transformers' own DeepseekV4ForCausalLM, in float32 on the CPU.

The tiny checkpoints are built here with transformers and saved with save_pretrained (DeepSeek's
tensor names, per-expert weights), then loaded by engine.deepseek_v4.load_folder. Every layer kind
appears: a sliding-window layer, CSA layers (entries every 4 tokens, the indexer keeping 3) and an
HCA layer (every 16 tokens), hash-routed then learned-routed MoE, two hyper-connection streams.
The prompt (70 tokens) is longer than the window (8) and than several blocks of both compressors.
The indexer has 8 heads: with 2, a quarter of its scores are exactly 0 (every head's ReLU zero),
and top-k's tie-breaking, which follows the length of each forward's candidate list (in
transformers too), would make outputs depend on how a sequence is cut into forwards.
"""
from __future__ import annotations

import json
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("transformers without deepseek_v4 (needs >= 5.8)", allow_module_level=True)

from batchd.engine.deepseek_v4 import generate_greedy, load_folder  # noqa: E402
from batchd.engine.deepseek_v4.weights import TensorFiles  # noqa: E402
from batchd.engine.errors import CheckpointError  # noqa: E402

PROMPT_LEN, WINDOW, CSA_RATE, HCA_RATE = 70, 8, 4, 16
TINY = dict(vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
            head_dim=32, q_lora_rank=48, num_experts_per_tok=2, n_routed_experts=4, sliding_window=WINDOW,
            o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=3, hc_mult=2,
            partial_rotary_factor=0.25, max_position_embeddings=512,
            compress_rates={"compressed_sparse_attention": CSA_RATE, "heavily_compressed_attention": HCA_RATE},
            layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                         "compressed_sparse_attention"],
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"])
VARIANTS = {
    "plain-rope": {},
    "yarn-compress-rope": dict(rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 32}),
}


def reference_model(seed: int = 0, **extra):
    """A random tiny DeepseekV4ForCausalLM whose zero-initialised parts (sinks, position biases,
    hyper-connection bases, routing tables) are random too, so each of them changes the logits."""
    torch.manual_seed(seed)
    config = transformers.DeepseekV4Config(**dict(TINY, **extra))
    model = transformers.DeepseekV4ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(part in name for part in ("position_bias", "sinks", ".base", "hc_base")):
                param.normal_(0, 0.5)
            elif name == "lm_head.weight":
                param.normal_(0, 0.5)  # spread the logits: greedy picks are far from ties
        for name, buffer in model.named_buffers():
            if name.endswith("tid2eid"):
                buffer.copy_(torch.randint(0, TINY["n_routed_experts"], buffer.shape))
            elif name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.1)
    return model


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def pair(request, tmp_path_factory):
    """(transformers' model, ours loaded from its save_pretrained folder)."""
    reference = reference_model(**VARIANTS[request.param])
    folder = tmp_path_factory.mktemp(f"v4-{request.param}")
    reference.save_pretrained(folder)
    ours, _ = load_folder(folder)
    return reference, ours


def prompt(n: int = PROMPT_LEN, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).norm() / reference.norm()).item()


def reference_step(model, ids, cache):
    with torch.no_grad():
        return model(ids, cache=cache, use_cache=True).logits.float()


def test_checkpoint_names_cover_every_layer_kind(tmp_path):
    """The saved checkpoint really holds DeepSeek's names for every part the model loads."""
    reference_model().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert set(config["layer_types"]) == {"sliding_attention", "compressed_sparse_attention",
                                          "heavily_compressed_attention"}
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.attn.indexer.compressor.ape" in names
    assert "model.layers.0.ffn.experts.3.w2.weight" in names and "model.layers.0.ffn.gate.tid2eid" in names


def test_prefill_matches_transformers(pair):
    reference, ours = pair
    ids = prompt()
    logits = ours(ids, ours.new_cache(128))
    assert relative_error(logits, reference_step(reference, ids, None)) < 1e-4


def test_decode_after_prefill_matches_transformers(pair):
    """Decode rows across window-close boundaries of both compressors (positions 70..81)."""
    reference, ours = pair
    ids, following = prompt(), prompt(12, seed=2)
    ref_cache, cache = transformers.DynamicCache(config=reference.config), ours.new_cache(128)
    reference_step(reference, ids, ref_cache), ours(ids, cache)
    for i in range(following.shape[1]):
        token = following[:, i : i + 1]
        assert relative_error(ours(token, cache), reference_step(reference, token, ref_cache)) < 1e-4, i


@pytest.mark.parametrize("q", [3, 6])
def test_verify_of_q_tokens_matches_transformers(pair, q):
    """q rows at once after a prefill (closing a CSA window inside the step), as speculative
    verification runs them."""
    reference, ours = pair
    ids, draft = prompt(), prompt(q, seed=3)
    ref_cache, cache = transformers.DynamicCache(config=reference.config), ours.new_cache(128)
    reference_step(reference, ids, ref_cache), ours(ids, cache)
    assert relative_error(ours(draft, cache), reference_step(reference, draft, ref_cache)) < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_on_cuda_in_float32_prefill_decode_and_verify_match_the_cpu(pair, tmp_path):
    """The CUDA path (the hyper-connection kernels, the padded row-step GEMMs and norms, the grouped
    MoE kernel) computes the same model as the CPU path above: logits within 1e-4. (Against our CPU
    model, which these tests hold to transformers: the GPU machine's transformers 5.17 decodes V4
    apart from 5.25's.)"""
    reference, ours = pair
    reference.save_pretrained(tmp_path)
    on_cuda, _ = load_folder(tmp_path, device="cuda")
    ids, following, draft = prompt(), prompt(6, seed=2), prompt(5, seed=3)
    cache, cuda_cache = ours.new_cache(128), on_cuda.new_cache(128)
    for rows in [ids] + [following[:, i : i + 1] for i in range(following.shape[1])] + [draft]:
        assert relative_error(on_cuda(rows.cuda(), cuda_cache).cpu(), ours(rows, cache)) < 1e-4, rows.shape


def test_greedy_generation_matches_transformers_token_for_token(pair):
    reference, ours = pair
    ids = prompt()
    with torch.no_grad():
        expected = reference.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert generate_greedy(ours, ids[0].tolist(), 24) == expected[0, PROMPT_LEN:].tolist()


def test_rollback_of_a_rejected_draft_matches_a_cache_that_never_saw_it(pair):
    """Verify 7 drafts from position 70 (closing CSA windows at 72 and 76 and the HCA window at
    80), keep 1, and decode on: every part of the cache (window rows, compressor projections,
    entries of both compressors and the indexer) must read as if the rejected rows never came."""
    _, ours = pair
    ids, draft, next_token = prompt(), prompt(7, seed=4), prompt(1, seed=5)
    cache = ours.new_cache(128)
    ours(ids, cache)
    ours(draft, cache)
    cache.truncate(PROMPT_LEN + 1)
    after_rollback = [ours(next_token, cache)] + [ours(draft[:, i : i + 1], cache) for i in range(6)]
    fresh = ours.new_cache(128)
    ours(torch.cat([ids, draft[:, :1]], dim=1), fresh)
    expected = [ours(next_token, fresh)] + [ours(draft[:, i : i + 1], fresh) for i in range(6)]
    for got, want in zip(after_rollback, expected):
        assert relative_error(got, want) < 1e-6


def test_request_two_after_reset_matches_a_fresh_cache(pair):
    _, ours = pair
    cache = ours.new_cache(128)
    ours(prompt(seed=6), cache)
    cache.reset()
    assert cache.length == 0
    second = ours(prompt(40, seed=7), cache)
    assert torch.equal(second, ours(prompt(40, seed=7), ours.new_cache(128)))


FP4_CODES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantise_fp8(weight: torch.Tensor, block: int, ue8m0: bool):
    """weight [N, K] -> (float8_e4m3fn values, scales [N / block, K / block]: float32, or UE8M0)."""
    N, K = weight.shape
    blocks = weight.float().reshape(N // block, block, K // block, block)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448).clamp(min=2**-100)
    if ue8m0:
        scale = scale.log2().ceil().exp2()
    values = (blocks / scale[:, None, :, None]).reshape(N, K).to(torch.float8_e4m3fn)
    return values, scale.to(torch.float8_e8m0fnu) if ue8m0 else scale


def quantise_fp4(weight: torch.Tensor, block: int, exponent_bytes: bool):
    """weight [N, K] -> (int8 [N, K / 2], two e2m1 codes a byte, low nibble first; UE8M0 scales
    [N, K / block], as float8_e8m0fnu or as their exponent bytes)."""
    N, K = weight.shape
    blocks = weight.float().reshape(N, K // block, block)
    scale = (blocks.abs().amax(dim=-1) / 6).clamp(min=2**-100).log2().ceil().exp2()
    x = (blocks / scale[..., None]).reshape(N, K)
    codes = (x.abs()[..., None] - FP4_CODES).abs().argmin(dim=-1) + 8 * (x < 0)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    if exponent_bytes:
        return packed, (scale.log2() + 127).to(torch.uint8)
    return packed, scale.to(torch.float8_e8m0fnu)


def test_fp8_and_fp4_checkpoints_load_as_transformers_dequantises_them(tmp_path, monkeypatch):
    """V4-Flash's formats: FP8 linears with block scales (float32 and UE8M0; transformers' and
    DeepSeek's scale names) and FP4 routed experts (UE8M0 scales as float8_e8m0fnu and as exponent
    bytes). Loaded, every parameter equals the one loaded from the same checkpoint dequantised by
    transformers' own FP8 dequantiser and saved in float32; and the weights stay close to the
    originals (so the nibble order and the block grid are right). The checkpoint is read one
    tensor at a time: when a tensor is read, at most one read before it (a weight whose scale
    this is) is still held."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    reference_model().save_pretrained(tmp_path / "bf16")
    original = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    quantised, kinds = dict(original), set()
    for i, (name, weight) in enumerate(sorted(original.items())):
        linear = (".attn.w" in name or ".shared_experts." in name) and name.endswith(".weight") and weight.dim() == 2
        if ".experts." in name and ".shared_experts." not in name:
            q, s = quantise_fp4(weight, 16, exponent_bytes=i % 2 == 0)
            scale_name = name.removesuffix(".weight") + ".scale"                          # DeepSeek's name
        elif linear and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0:
            q, s = quantise_fp8(weight, 16, ue8m0=i % 2 == 0)
            scale_name = name + "_scale_inv" if i % 3 else name.removesuffix(".weight") + ".scale"
        else:
            continue
        quantised[name], quantised[scale_name] = q, s
        kinds.add((q.dtype, s.dtype))
    assert kinds == {(torch.float8_e4m3fn, torch.float32), (torch.float8_e4m3fn, torch.float8_e8m0fnu),
                     (torch.int8, torch.uint8), (torch.int8, torch.float8_e8m0fnu)}
    (tmp_path / "quantised").mkdir()
    (tmp_path / "quantised" / "config.json").write_text((tmp_path / "bf16" / "config.json").read_text())
    save_file(quantised, str(tmp_path / "quantised" / "model.safetensors"))

    reference = Fp8Dequantize(None)
    dequantised = {name: t for name, t in quantised.items() if not name.endswith(("_scale_inv", ".scale"))}
    for name, scale in quantised.items():
        if name.endswith(("_scale_inv", ".scale")):
            weight = name.removesuffix("_scale_inv") if name.endswith("_scale_inv") else name.removesuffix(".scale") + ".weight"
            dequantised[weight] = reference._dequantize_one(quantised[weight], scale, output_dtype=torch.float32)
    (tmp_path / "dequantised").mkdir()
    (tmp_path / "dequantised" / "config.json").write_text((tmp_path / "bf16" / "config.json").read_text())
    save_file(dequantised, str(tmp_path / "dequantised" / "model.safetensors"))

    read, most_held = [], [0]
    original_read = TensorFiles.__getitem__

    def tracked_read(self, name):
        most_held[0] = max(most_held[0], sum(ref() is not None for ref in read))
        tensor = original_read(self, name)
        read.append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(TensorFiles, "__getitem__", tracked_read)
    ours, _ = load_folder(tmp_path / "quantised")
    monkeypatch.undo()
    assert len(read) == len(quantised) and most_held[0] == 1
    theirs, _ = load_folder(tmp_path / "dequantised")
    plain, _ = load_folder(tmp_path / "bf16")
    for (name, got), (_, want), (_, before) in zip(ours.state_dict().items(), theirs.state_dict().items(),
                                                   plain.state_dict().items()):
        assert torch.equal(got, want), name
        if got.is_floating_point():
            assert relative_error(got, before) < 0.2, name     # FP4 keeps about one significant bit
    assert torch.equal(ours(prompt(seed=8), ours.new_cache(128)), theirs(prompt(seed=8), theirs.new_cache(128)))


def test_a_checkpoint_file_is_opened_once_however_many_tensors_it_holds(tmp_path, monkeypatch):
    """Opening a safetensors file parses its whole header (14 ms a tensor for a 20,000-tensor shard
    if it were opened per tensor): each file is opened once for the whole load."""
    import safetensors

    reference_model().save_pretrained(tmp_path)
    opened, original_open = [], safetensors.safe_open

    def counting_open(*args, **kwargs):
        opened.append(args[0])
        return original_open(*args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", counting_open)
    model, _ = load_folder(tmp_path)
    assert len(opened) == 1 and sum(1 for _ in model.state_dict()) > 50


def test_a_model_larger_than_the_device_is_refused_before_anything_is_allocated(tmp_path, monkeypatch):
    """The weights' bytes are counted from the config first: a V4-Flash on one GPU fails at once
    with the sizes, not with an allocator error half-way through the layers."""
    from batchd.engine.deepseek_v4 import model as v4_model
    from batchd.engine.errors import DeviceOutOfMemoryError

    reference_model().save_pretrained(tmp_path)
    monkeypatch.setattr(v4_model, "free_device_bytes", lambda device: 1e5)
    monkeypatch.setattr(v4_model, "build_model", lambda *args: pytest.fail("allocated before the check"))
    with pytest.raises(DeviceOutOfMemoryError, match=r"its 4 layers need 0\.\d+ GB of weights in float32 and cpu has 0\.0001 GB free"):
        load_folder(tmp_path)


def test_a_scale_without_its_weight_or_of_another_format_says_what_to_do(tmp_path):
    from safetensors.torch import load_file, save_file

    reference_model().save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    save_file(tensors | {"model.layers.0.attn.wq_z.scale": torch.ones(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="no model.layers.0.attn.wq_z.weight; the checkpoint is incomplete"):
        load_folder(tmp_path)
    save_file(tensors | {"model.layers.0.attn.wq_a.weight_scale_2": torch.ones(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="convert the checkpoint to bfloat16"):
        load_folder(tmp_path)


def test_mtp_weights_are_set_aside_and_reported(tmp_path):
    from safetensors.torch import load_file, save_file

    reference_model().save_pretrained(tmp_path)
    _, aside = load_folder(tmp_path)
    assert "no MTP layer" in aside.notes[0]
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["mtp.0.enorm.weight"] = torch.ones(TINY["hidden_size"])
    save_file(tensors, str(tmp_path / "model.safetensors"))
    _, aside = load_folder(tmp_path)
    assert list(aside.mtp) == ["mtp.0.enorm.weight"] and "drafter of --spec draft" in aside.notes[0]


def test_missing_tensor_names_the_layout(tmp_path):
    from safetensors.torch import load_file, save_file

    reference_model().save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.2.attn.compressor.ape"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing.*layers.2.self_attn.compressor.position_bias"):
        load_folder(tmp_path)


# ---- the feature gate row (engine.architectures, enforced by engine.capabilities) ----------------

def test_a_v4_checkpoint_cannot_be_loaded_as_a_llama_style_model_or_drafter(tmp_path):
    from batchd.engine.checkpoint import load_checkpoint

    reference_model().save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="has its own model.*cannot be a drafter"):
        load_checkpoint(tmp_path)


def test_v4_admits_lookup_and_draft_whose_reason_says_it_needs_an_mtp_layer():
    """The row admits draft (the MTP layer drafts); a checkpoint without one refuses it per job
    with the row's reason (test_deepseek_v4_mtp.py)."""
    from batchd.engine.capabilities import capabilities_for, check_features

    assert check_features("deepseek_v4", "cuda", spec="lookup") == []
    assert check_features("deepseek_v4", "cuda", spec="draft") == []
    assert "MTP layer" in capabilities_for("deepseek_v4").reason("--spec draft")


def test_v4_refuses_block_sparse_attention_and_says_why():
    from batchd.engine.capabilities import check_features
    from batchd.engine.errors import UnsupportedFeatureError

    with pytest.raises(UnsupportedFeatureError, match="attends sparsely"):
        check_features("deepseek_v4", "cuda", attention="sparse")


def test_v4_takes_a_dense_pflash_drafter_and_never_drafts_for_it():
    from batchd.engine.capabilities import check_compression
    from batchd.engine.errors import UnsupportedFeatureError
    from batchd.engine.types import CompressionOptions

    options = CompressionOptions(mode="always", drafter_path="/models/qwen3-0.6b")
    assert check_compression("deepseek_v4", "cuda", options, drafter_architecture="qwen3") == []
    with pytest.raises(UnsupportedFeatureError, match="cannot be a PFlash drafter.*dense attention rows"):
        check_compression("llama", "cuda", options, drafter_architecture="deepseek_v4")


# ---- config.json as the upstream checkpoint writes it, and bfloat16 ------------------------------

LEGACY = dict({k: v for k, v in TINY.items() if k not in ("layer_types", "mlp_layer_types", "compress_rates",
                                                           "partial_rotary_factor")},
              compress_ratios=[0, 4, 128, 4], num_hash_layers=1, qk_rope_head_dim=8, compress_rope_theta=160000.0,
              rope_scaling={"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
                            "beta_fast": 32, "beta_slow": 1})


def test_legacy_config_keys_read_as_transformers_reads_them():
    """compress_ratios, num_hash_layers, qk_rope_head_dim and a flat yarn rope_scaling (the
    upstream config.json): the same layer kinds and rope frequencies as transformers derives."""
    from batchd.engine.deepseek_v4 import V4Config
    from batchd.engine.deepseek_v4.rope import inverse_frequencies

    reference = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**LEGACY))
    ours = V4Config.from_hf_dict(LEGACY)
    assert ours.layer_types == reference.config.layer_types and ours.mlp_layer_types == reference.config.mlp_layer_types
    rotary = reference.model.rotary_emb
    for family, params in (("main", ours.rope_main), ("compress", ours.rope_compress)):
        inv_freq, scale = inverse_frequencies(params, ours.rope_dim)
        assert torch.allclose(inv_freq, getattr(rotary, f"{family}_inv_freq"))
        assert scale == getattr(rotary, f"{family}_attention_scaling")
    assert ours.rope_compress.rope_type == "yarn"


def test_a_config_with_the_wrong_number_of_layer_kinds_names_the_file():
    from batchd.engine.deepseek_v4 import V4Config

    with pytest.raises(CheckpointError, match="config.json: layer_types has 3 entries for 4 layers"):
        V4Config.from_hf_dict(dict(TINY, layer_types=TINY["layer_types"][:3]))


def test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(tmp_path):
    """bf16 is not bitwise transformers' (casts fall in other places); both keep the same parts
    in float32, and ours must stay as close to the float32 logits as theirs."""
    reference = reference_model()
    reference.save_pretrained(tmp_path)
    theirs_bf16 = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    ours_bf16, _ = load_folder(tmp_path, dtype=torch.bfloat16)
    ids = prompt()
    exact = reference_step(reference, ids, None)
    ours = ours_bf16(ids, ours_bf16.new_cache(128))
    assert relative_error(ours, exact) <= 1.5 * relative_error(reference_step(theirs_bf16, ids, None), exact)
