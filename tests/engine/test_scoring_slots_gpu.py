"""CUDA-only: PFlash's padded scoring with 4 slots at the shape it serves (a Qwen2.5-0.5B-shape
drafter in bf16, 4K-token prompts) keeps a prompt's bits in any slot and beside any neighbours,
through the captured graphs: cuBLAS must give each row the same bits wherever it sits in the
[4 x 4,096, K] GEMMs. Skipped where there is no GPU; run on the device machine."""
from __future__ import annotations

import pytest
import torch

from batchd.engine.model import build_model
from batchd.engine.pflash.scoring import PaddedScorer
from batchd.engine.presets import preset

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def drafter():
    return build_model(preset("qwen2.5-0.5b"), "cuda", torch.bfloat16, seed=1)


def prompts(n: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3700, 4096, (n,), generator=generator).tolist()   # all pad to 4,096
    return [torch.randint(0, 151936, (k,), generator=generator).tolist() for k in lengths]


def test_four_slots_keep_a_prompts_bits_in_any_slot_and_any_company(drafter):
    scorer = PaddedScorer(drafter, slots=4)
    [mine] = prompts(1, seed=0)
    alone = scorer.score(mine)
    for waiting, seed in ((4, 1), (5, 2), (9, 3)):
        others = prompts(waiting - 1, seed)
        for at in (0, min(3, waiting - 1)):
            together = scorer.score_many(others[:at] + [mine] + others[at:])
            assert torch.equal(together[at], alone), (waiting, at)


def test_four_slot_graphs_replay_the_eager_forward(drafter):
    waiting = prompts(3, seed=4)
    graphed = PaddedScorer(drafter, slots=4).score_many(waiting)
    eager = PaddedScorer(drafter, slots=4, cuda_graphs=False).score_many(waiting)
    for a, b in zip(graphed, eager):
        assert torch.equal(a, b)
    one = PaddedScorer(drafter).score_many(waiting)
    for a, b in zip(one, graphed):   # another GEMM shape: close, not equal
        torch.testing.assert_close(b, a, rtol=2e-2, atol=1e-4)
