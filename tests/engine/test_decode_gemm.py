"""BatchOptions.decode_gemm: the invariant product of the batch engine's CUDA decode rows, "slabs"
(cuBLAS over fixed slabs, the default) or "row_gemm" (kernels.row_gemm, opt-in).

On the CPU: the option is validated, reaches the target's rows and every drafter's pool, leaves the
CPU path (and so the ids) unchanged, and project_invariant routes non-CPU rows by it. On CUDA: a
job's ids alone equal its ids in a batch with row_gemm at real model shapes (random weights).
"""
from __future__ import annotations

import random

import pytest
import torch

from batchd.engine.batch import BatchOptions
from batchd.engine.batch import rows as rows_module
from batchd.engine.types import GenerationRequest, SamplingParams, SpeculationOptions


def test_batch_options_refuse_an_unknown_decode_gemm():
    assert BatchOptions().decode_gemm == "slabs"
    assert BatchOptions(decode_gemm="row_gemm").decode_gemm == "row_gemm"
    with pytest.raises(ValueError, match="decode_gemm must be 'slabs' or 'row_gemm', got 'cublas'"):
        BatchOptions(decode_gemm="cublas")


@pytest.mark.parametrize("decode_gemm", ["slabs", "row_gemm"])
def test_project_invariant_routes_device_rows_by_decode_gemm(monkeypatch, decode_gemm):
    """Rows off the CPU (meta tensors here, CUDA in the engine) go to row_linear or to the slabs;
    without slab_rows (batch_invariant=False) to one F.linear whatever the option."""
    calls = []
    monkeypatch.setattr(rows_module, "row_linear", lambda x, w, b: calls.append("row_gemm") or x @ w.T)
    monkeypatch.setattr(rows_module, "project_slabs", lambda x, w, b, slab: calls.append("slabs") or x @ w.T)
    x, w = torch.empty(5, 8, device="meta"), torch.empty(3, 8, device="meta")
    assert rows_module.project_invariant(x, w, None, 128, None, decode_gemm).shape == (5, 3)
    assert calls == [decode_gemm]


def test_row_gemm_reaches_rows_and_drafter_pools_and_leaves_the_cpu_ids():
    pytest.importorskip("transformers")
    from batchd.engine.runtime import Engine, EngineConfig
    from batchd.engine.speculative import self_drafter
    from tests.engine.tiny_models import hf_model, ours_from_hf

    engine = Engine(ours_from_hf(hf_model("llama")), None, EngineConfig(max_context=256), eos_ids=set())
    engine.drafters.register("self", self_drafter(engine.drafters.target))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 37)]
    specs = [SpeculationOptions(), SpeculationOptions("draft", drafter_path="self", width=3)]
    got = {}
    for decode_gemm in ("slabs", "row_gemm"):
        batch = engine.batch_engine(BatchOptions(block_size=8, prefill_chunk=16, max_step_tokens=32,
                                                 decode_gemm=decode_gemm))
        seqs = [batch.submit(p, GenerationRequest(sampling=SamplingParams(max_new_tokens=12), speculation=s))
                for p, s in zip(prompts, specs)]
        while batch.has_work:
            batch.step()
        assert batch.rows.decode_gemm == decode_gemm
        assert [pooled.rows.decode_gemm for pooled in batch._pooled.values()] == [decode_gemm]
        got[decode_gemm] = [s.generated for s in seqs]
    assert got["row_gemm"] == got["slabs"]


# ----------------------------------------------------------------------------------- CUDA only

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["qwen2.5-1.5b", "llama-3-8b"])
def test_cuda_row_gemm_ids_alone_equal_ids_in_a_batch(name):
    from batchd.engine.presets import preset
    from batchd.engine.runtime import Engine, EngineConfig, build_model

    config = preset(name)
    engine = Engine(build_model(config, "cuda", torch.bfloat16, seed=3), None,
                    EngineConfig(max_context=2048, prefill_chunk=256), eos_ids=set())
    try:
        batch = engine.batch_engine(BatchOptions(block_size=64, max_step_tokens=1024, decode_gemm="row_gemm"))
        rng = random.Random(0)
        prompts = [[rng.randrange(config.vocab_size) for _ in range(rng.randrange(20, 600))] for _ in range(40)]
        news = [rng.randrange(8, 32) for _ in range(40)]

        def run(indices):
            seqs = {i: batch.submit(prompts[i], GenerationRequest(
                sampling=SamplingParams(max_new_tokens=news[i], ignore_eos=True))) for i in indices}
            while batch.has_work:
                batch.step()
            return {i: s.generated for i, s in seqs.items()}

        together = run(range(40))
        assert {i: together[i] for i in (0, 7, 39)} == {i: run([i])[i] for i in (0, 7, 39)}
        assert run(range(39, 19, -1)) == {i: together[i] for i in range(20, 40)}
    finally:
        engine.close()
