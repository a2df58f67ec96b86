"""moe_experts: the grouped Triton kernel against its reference twin and the engine's expert loop,
a token's output bitwise the same alone and in a batch, and only the routed experts' weights read.

On the CPU the kernel runs under TRITON_INTERPRET=1 (conftest) with small tiles that still reach
every path: several tiles of one expert, ragged H / I edges, experts no token chose, the unused
tail of the grid. On CUDA the same tests run compiled.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from batchd.kernels.moe_experts import moe_experts, moe_experts_reference
from tests.kernels.conftest import DEVICE, REL_ERR, needs_triton, rel_err

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DTYPE_IDS = ["bf16", "f16", "f32"]
LIMIT = 1.5          # low enough that the clamps bite on random inputs


def small_config():
    from batchd.kernels.moe_experts.triton_kernel import MoeConfig

    return MoeConfig(block_m=16, gate_up_block_n=16, down_block_n=16, block_k=16, num_warps=4, num_stages=2)


def make(N, H, I, E, k, dtype, seed=0):
    """Random x, router output (k distinct experts a token, weights in float32) and expert weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g).to(dtype)
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    weights = torch.rand(N, k, generator=g)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) / H**0.5 * 3).to(dtype)
    down = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)
    return [t.to(DEVICE) for t in (x, weights, experts, gate_up, down)]


def run_kernel(x, weights, experts, gate_up, down):
    return moe_experts(x, weights, experts, gate_up, down, LIMIT, backend="triton",
                       config=small_config() if DEVICE == "cpu" else None)


def engine_experts(gate_up, down):
    """engine.deepseek_v4.moe.Experts holding these weights."""
    from batchd.engine.deepseek_v4.moe import Experts

    E, H, I = down.shape
    config = SimpleNamespace(num_experts=E, hidden_size=H, moe_intermediate_size=I, swiglu_limit=LIMIT)
    module = Experts(config).to(device=down.device, dtype=down.dtype)
    module.gate_up_proj.data, module.down_proj.data = gate_up, down
    return module


def test_reference_matches_the_engine_loop_over_experts():
    x, weights, experts, gate_up, down = (t.cpu() for t in make(9, 24, 20, 6, 3, torch.float32))
    loop = engine_experts(gate_up, down)(x, weights, experts)
    assert rel_err(moe_experts_reference(x, weights, experts, gate_up, down, LIMIT), loop) < 1e-6


@needs_triton
@pytest.mark.triton
def test_engine_experts_run_the_kernel_when_asked_and_agree_with_the_loop():
    x, weights, experts, gate_up, down = make(11, 32, 24, 5, 2, torch.float32)
    module = engine_experts(gate_up, down)
    loop = module.loop_over_experts(x, weights, experts)
    module.backend = "triton"
    kernel = module(x, weights, experts)
    assert torch.equal(kernel, moe_experts(x, weights, experts, gate_up, down, LIMIT, backend="triton"))
    assert rel_err(kernel, loop) < REL_ERR[torch.float32]


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("N, H, I, E, k", [
    pytest.param(1, 32, 32, 8, 2, id="one-token"),
    pytest.param(13, 40, 24, 5, 3, id="ragged-h-i"),
    pytest.param(24, 32, 48, 3, 2, id="several-tiles-an-expert"),
])
def test_triton_matches_reference(N, H, I, E, k, dtype):
    inputs = make(N, H, I, E, k, dtype)
    got = run_kernel(*inputs)
    want = moe_experts_reference(*inputs, LIMIT)
    assert got.dtype == dtype and got.shape == (N, H)
    assert rel_err(got, want) < REL_ERR[dtype]


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_tokens_output_is_bitwise_the_same_alone_and_in_a_batch(dtype):
    x, weights, experts, gate_up, down = make(21, 32, 24, 4, 2, dtype)
    batch = run_kernel(x, weights, experts, gate_up, down)
    for i in (0, 7, 20):
        alone = run_kernel(x[i:i + 1], weights[i:i + 1], experts[i:i + 1], gate_up, down)
        assert torch.equal(alone[0], batch[i])
    shuffled = torch.randperm(21, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    reordered = run_kernel(x[shuffled], weights[shuffled], experts[shuffled], gate_up, down)
    assert torch.equal(reordered, batch[shuffled])


@needs_triton
@pytest.mark.triton
def test_weights_of_experts_no_token_chose_never_reach_the_output():
    x, weights, experts, gate_up, down = make(3, 32, 16, 8, 2, torch.float32)
    unused = sorted(set(range(8)) - set(experts.flatten().tolist()))
    assert unused
    poisoned_gate_up, poisoned_down = gate_up.clone(), down.clone()
    poisoned_gate_up[unused], poisoned_down[unused] = float("nan"), float("nan")
    assert torch.equal(run_kernel(x, weights, experts, poisoned_gate_up, poisoned_down),
                       run_kernel(x, weights, experts, gate_up, down))


def test_tiles_cover_each_pair_once_within_one_expert():
    from batchd.kernels.moe_experts.triton_kernel import max_blocks, plan_blocks

    experts = torch.tensor([[3, 0], [3, 1], [0, 3], [5, 3], [3, 2]])
    plan = plan_blocks(experts, num_experts=6, block_m=2)
    flat = experts.flatten()
    assert plan.expert.shape[0] == max_blocks(10, 6, 2)
    seen = []
    for expert, begin, end in zip(plan.expert.tolist(), plan.begin.tolist(), plan.end.tolist()):
        pairs = plan.sorted_pairs[begin:end].tolist()
        assert len(pairs) <= 2 and all(flat[p] == expert for p in pairs)
        seen += pairs
    assert sorted(seen) == list(range(10))
    used = {e for e, b, end in zip(plan.expert.tolist(), plan.begin.tolist(), plan.end.tolist()) if end > b}
    assert used == {0, 1, 2, 3, 5}                                 # expert 4 gets no tile: never read
    # experts 0, 1, 2, 5: a tile each; 3 (5 pairs): 3 tiles
    assert sum(e > b for b, e in zip(plan.begin.tolist(), plan.end.tolist())) == 7


@needs_triton
@pytest.mark.triton
def test_no_tokens_give_an_empty_result():
    x, weights, experts, gate_up, down = make(2, 16, 16, 3, 2, torch.float32)
    assert run_kernel(x[:0], weights[:0], experts[:0], gate_up, down).shape == (0, 16)


def test_wrong_shapes_say_what_fits():
    x, weights, experts, gate_up, down = make(2, 16, 8, 3, 2, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        moe_experts(x, weights, experts, gate_up[:, :-1], down, LIMIT)
    with pytest.raises(ValueError, match=r"\[2, k\]"):
        moe_experts(x, weights[:, :1], experts, gate_up, down, LIMIT)
