"""The drafter residency lifecycle on SmolLM2 (CPU): park, load, score, release, unpark, with a
failure injected at each step. After every job: no drafter left alive, the target's weights
and cache back, and the next job's output SHA equal to a fresh worker's."""
from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

from batchd.engine.errors import CheckpointError, EngineError
from batchd.engine.pflash import PromptCompressor, ensure_target_resident
from batchd.engine.checkpoint import load_checkpoint
from batchd.engine.residency import DrafterError, Residency, TargetRestoreError, drafter_bytes_needed
from batchd.engine.runtime import Engine, EngineConfig
from batchd.engine.types import CompressionOptions, GenerationRequest, SamplingParams
from tests.engine.test_pflash_helpers import llama3_tokenizer_json, long_paper_text, smollm2_folder, tiny_drafter

PLAIN_JOB = GenerationRequest(prompt="Name three planets of the solar system.", chat=True,
                              sampling=SamplingParams(max_new_tokens=12))


@pytest.fixture(scope="module")
def drafter_path(tmp_path_factory) -> str:
    return str(tiny_drafter(tmp_path_factory.mktemp("drafter"), llama3_tokenizer_json()))


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load(str(smollm2_folder()), EngineConfig(max_context=2048))


@pytest.fixture(scope="module")
def fresh_sha() -> str:
    """The plain job on a worker that never compressed anything."""
    fresh = Engine.load(str(smollm2_folder()), EngineConfig(max_context=2048))
    sha = fresh.generate(PLAIN_JOB).output_sha256
    fresh.close()
    return sha


@pytest.fixture(scope="module")
def original_weights(engine) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in engine.model.named_parameters()}


def compressing_job(drafter_path: str) -> GenerationRequest:
    prompt = " ".join(long_paper_text().split(" ")[:300]) + "\n\nWhat is this paper about?"
    return GenerationRequest(prompt=prompt, chat=True, sampling=SamplingParams(max_new_tokens=4),
                             compression=CompressionOptions(mode="always", keep_ratio=0.5, drafter_path=drafter_path))


def use(engine, **residency_options) -> Residency:
    residency = Residency(**residency_options)
    engine.compressor = PromptCompressor(residency)
    return residency


def assert_target_restored(engine, residency: Residency, original_weights) -> None:
    assert residency.parked is None
    for name, p in engine.model.named_parameters():
        assert p.device == engine.device and torch.equal(p, original_weights[name]), name
    assert all(k.shape == (1, engine.config.num_kv_heads, 2048, engine.config.head_dim) for k in engine.cache.keys)
    gc.collect()
    assert residency.last_drafter is None or residency.last_drafter() is None, "the drafter leaked"


def test_parking_is_skipped_when_both_fit(engine, drafter_path, original_weights):
    residency = use(engine)  # auto: on the CPU everything fits
    result = engine.generate(compressing_job(drafter_path))
    tel = result.telemetry
    assert tel.compressed and tel.park_s == 0 and not any("parked" in n for n in tel.notes)
    assert tel.drafter_load_s > 0 and tel.scoring_s > 0
    assert_target_restored(engine, residency, original_weights)


def test_a_drafter_that_fits_stays_resident_for_the_next_job_however_its_path_is_spelled(
        engine, drafter_path, original_weights, tmp_path):
    residency = use(engine, keep_resident=1)
    first = engine.generate(compressing_job(drafter_path))
    link = tmp_path / "same-drafter"
    link.symlink_to(drafter_path)
    respelled = str(Path(drafter_path).parent) + "/./" + Path(drafter_path).name
    second = engine.generate(compressing_job(respelled))
    third = engine.generate(compressing_job(str(link)))
    assert first.telemetry.drafter_load_s > 0
    assert any("kept resident" in n for n in first.telemetry.notes)
    for later in (second, third):
        assert later.telemetry.drafter_load_s == 0 and later.telemetry.scoring_s > 0
        assert later.effective_prompt_tokens == first.effective_prompt_tokens
        assert later.output_sha256 == first.output_sha256
    assert len(residency.resident) == 1
    # a job whose drafter does not fit drops the resident one before it parks the target
    residency.free_bytes = lambda device: 0
    other = str(tiny_drafter(tmp_path / "other", llama3_tokenizer_json()))
    tel = engine.generate(compressing_job(other)).telemetry
    assert tel.compressed and tel.park_s > 0 and not residency.resident
    assert_target_restored(engine, residency, original_weights)
    engine.compressor = PromptCompressor(Residency())


@pytest.mark.parametrize("short_by", ["everything", "less than the cache"])
def test_auto_parks_what_the_drafter_needs(engine, drafter_path, original_weights, short_by):
    job = compressing_job(drafter_path)
    prompt_tokens = len(engine.codec.encode_request(job.prompt, None, True))
    needed = drafter_bytes_needed(load_checkpoint(drafter_path), torch.float32, 2 * prompt_tokens, 8192)
    cache = engine.cache.nbytes
    if short_by == "everything":  # freeing the cache is not enough: the weights go too
        residency, parked = Residency(headroom_bytes=cache, free_bytes=lambda device: 0), "KV cache and weights"
    else:  # the cache alone makes room
        residency, parked = Residency(headroom_bytes=cache // 2, free_bytes=lambda device: needed), "KV cache"
    engine.compressor = PromptCompressor(residency)
    tel = engine.generate(job).telemetry
    assert tel.park_s > 0 and any(f"parked the target's {parked} " in n for n in tel.notes)
    assert_target_restored(engine, residency, original_weights)


def test_park_synchronises_every_stream_before_freeing(engine, original_weights, drafter_path):
    seen = []
    pointers = {name: p.data_ptr() for name, p in engine.model.named_parameters()}
    cache_sizes = [k.numel() for k in engine.cache.keys]

    def synchronize(device):
        weights_in_place = all(p.data_ptr() == pointers[n] for n, p in engine.model.named_parameters())
        cache_in_place = [k.numel() for k in engine.cache.keys] == cache_sizes
        seen.append(weights_in_place and cache_in_place)

    residency = use(engine, park="always", synchronize=synchronize)
    engine.generate(compressing_job(drafter_path))
    assert seen and seen[0], "the first synchronise must come before any buffer is freed"
    assert_target_restored(engine, residency, original_weights)


def test_park_moves_weights_off_and_unpark_brings_them_back(engine, original_weights):
    residency = Residency(strategy="host")
    residency.park(engine)
    assert all(k.numel() == 0 for k in engine.cache.keys + engine.cache.values)
    host = residency.host_weights
    assert all(p.data_ptr() == host[n].data_ptr() for n, p in engine.model.named_parameters())
    residency.unpark(engine)
    assert_target_restored(engine, residency, original_weights)


@pytest.mark.parametrize("strategy", ["host", "reload"])
def test_next_job_after_a_compressed_one_matches_a_fresh_worker(engine, drafter_path, fresh_sha,
                                                               original_weights, strategy):
    residency = use(engine, park="always", strategy=strategy)
    compressed = engine.generate(compressing_job(drafter_path))
    assert compressed.telemetry.compressed and compressed.telemetry.park_s > 0
    assert compressed.telemetry.unpark_s > 0
    assert engine.generate(PLAIN_JOB).output_sha256 == fresh_sha
    assert_target_restored(engine, residency, original_weights)


class Inject:
    """A step hook that raises at `step` (the first `times` times it is reached) and keeps a
    weak reference to every drafter it sees."""

    def __init__(self, step: str, times: int = 1):
        self.step, self.times, self.drafters = step, times, []

    def __call__(self, step, obj):
        if step in ("load", "score"):
            self.drafters.append(weakref.ref(obj.model))
        if step == self.step and self.times > 0:
            self.times -= 1
            raise RuntimeError(f"injected failure at {step}")


@pytest.mark.parametrize("step", ["park", "load", "score"])
def test_drafter_failure_releases_it_restores_the_target_and_the_worker_serves_on(
        engine, drafter_path, fresh_sha, original_weights, step):
    hook = Inject(step)
    residency = use(engine, park="always", step_hook=hook)
    with pytest.raises(DrafterError, match=f"injected failure at {step}") as info:
        engine.generate(compressing_job(drafter_path))
    assert info.value.kind == "model_error" and "the target was restored" in info.value.message
    del info
    gc.collect()
    assert all(ref() is None for ref in hook.drafters), "a failed drafter stayed alive"
    assert_target_restored(engine, residency, original_weights)
    assert engine.generate(PLAIN_JOB).output_sha256 == fresh_sha
    assert engine.generate(compressing_job(drafter_path)).telemetry.compressed  # compression works again


def test_unpark_failure_falls_back_to_reloading_the_checkpoint(engine, drafter_path, fresh_sha, original_weights):
    residency = use(engine, park="always", strategy="host", step_hook=Inject("unpark"))
    result = engine.generate(compressing_job(drafter_path))
    assert result.telemetry.compressed
    assert any("restoring the target by host: RuntimeError: injected failure at unpark failed; restored by reload"
               in n for n in result.telemetry.notes)
    assert_target_restored(engine, residency, original_weights)
    assert engine.generate(PLAIN_JOB).output_sha256 == fresh_sha


def test_unpark_failing_both_ways_is_reported_and_retried_by_the_next_job(engine, drafter_path, fresh_sha,
                                                                          original_weights):
    hook = Inject("unpark", times=2)  # host fails, the reload fallback fails too
    residency = use(engine, park="always", step_hook=hook)
    with pytest.raises(TargetRestoreError, match="could not be restored.*restart the worker") as info:
        engine.generate(compressing_job(drafter_path))
    assert info.value.kind == "internal"
    assert residency.parked is not None
    hook.times = 2  # still failing both ways: the next compressing job tries to restore first, and says so
    with pytest.raises(TargetRestoreError):
        engine.generate(compressing_job(drafter_path))
    ensure_target_resident(engine)  # what the worker calls before any job: now it works
    assert_target_restored(engine, residency, original_weights)
    assert engine.generate(PLAIN_JOB).output_sha256 == fresh_sha
    assert engine.generate(compressing_job(drafter_path)).telemetry.compressed


def test_a_corrupt_drafter_checkpoint_fails_the_job_cleanly(engine, drafter_path, tmp_path, fresh_sha,
                                                            original_weights):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(drafter_path, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    residency = use(engine, park="always")
    with pytest.raises(CheckpointError, match="model.safetensors") as info:
        engine.generate(compressing_job(str(broken)))
    assert isinstance(info.value, EngineError) and info.value.kind == "model_error"
    assert_target_restored(engine, residency, original_weights)
    assert engine.generate(PLAIN_JOB).output_sha256 == fresh_sha


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory) -> Engine:
    folder = tiny_drafter(tmp_path_factory.mktemp("tiny-target"), llama3_tokenizer_json(), seed=3,
                          architecture="qwen2")  # q/k/v biases too
    return Engine.load(str(folder), EngineConfig(max_context=256))


def test_reload_reads_the_folder_into_the_fused_weights(tiny_engine):
    before = {name: p.detach().clone() for name, p in tiny_engine.model.named_parameters()}
    residency = Residency(park="always", strategy="reload")
    residency.park(tiny_engine)
    assert all(p.numel() == 0 for p in tiny_engine.model.parameters())
    residency.unpark(tiny_engine)
    for name, p in tiny_engine.model.named_parameters():
        assert torch.equal(p, before[name]), name  # q/k/v biases and gate/up rows included


@pytest.mark.parametrize("strategy", ["host", "reload"])
def test_unpark_stores_down_transposed_again_for_the_fused_mlp(tiny_engine, strategy):
    """A restore brings plain weights back; an engine on the fused MLP (BATCHD_FUSED_MLP=1 on CUDA,
    forced here on the CPU) must get down's transposed storage back, or its decode steps would take
    the chain and its sums' other order."""
    before = {name: p.detach().clone() for name, p in tiny_engine.model.named_parameters()}
    tiny_engine.fused_mlp = tiny_engine.model.use_fused_mlp(True)
    try:
        residency = Residency(park="always", strategy=strategy)
        residency.park(tiny_engine)
        residency.unpark(tiny_engine)
        for layer in tiny_engine.model.layers:
            assert layer.mlp.down_proj.weight.t().is_contiguous()
        for name, p in tiny_engine.model.named_parameters():
            assert torch.equal(p, before[name]), name
    finally:
        tiny_engine.fused_mlp = tiny_engine.model.use_fused_mlp(False)


def test_reload_refuses_a_checkpoint_changed_since_the_park(tiny_engine):
    import os

    weights = Path(tiny_engine.checkpoint_path) / "model.safetensors"
    stat = weights.stat()
    residency = Residency(park="always", strategy="reload")
    residency.park(tiny_engine)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    try:
        with pytest.raises(TargetRestoreError, match="changed on disk since the target was parked"):
            residency.unpark(tiny_engine)
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    residency.ensure_resident(tiny_engine)  # the same files again: the restore goes through
    assert residency.parked is None and all(p.numel() > 0 for p in tiny_engine.model.parameters())


class CountSteps:
    def __init__(self):
        self.counts: dict[str, int] = {}

    def __call__(self, step, obj):
        self.counts[step] = self.counts.get(step, 0) + 1


def test_jobs_arriving_together_share_one_park_and_unpark(engine, drafter_path, original_weights, tmp_path):
    """Four compressing jobs added together: one drafter load, one park, one unpark; each job
    is compressed and generated exactly as it is alone, and carries a quarter of the visit."""
    words = long_paper_text().split(" ")
    jobs = [GenerationRequest(prompt=" ".join(words[80 * i: 80 * i + 300]) + "\n\nWhat is this paper about?",
                              chat=True, sampling=SamplingParams(max_new_tokens=4),
                              compression=CompressionOptions(mode="always", keep_ratio=0.5, drafter_path=drafter_path))
            for i in range(4)]
    missing = CompressionOptions(mode="always", keep_ratio=0.5, drafter_path=str(tmp_path / "no-such-drafter"))
    jobs.append(GenerationRequest(prompt=jobs[0].prompt, chat=True, sampling=SamplingParams(max_new_tokens=4),
                                  compression=missing))
    use(engine, park="always")
    alone = [engine.generate(job) for job in jobs[:4]]
    counter = CountSteps()
    residency = use(engine, park="always", step_hook=counter)
    together = dict(engine.generate_many(jobs))
    unparked = counter.counts.pop("unpark")   # the hook runs once per weight restored
    assert counter.counts == {"park": 1, "load": 1, "score": 1, "release": 1} and unparked > 0
    assert isinstance(together[4], EngineError) and "no such file" in str(together[4])   # it fails alone
    for i in range(4):
        got, ref = together[i], alone[i]
        assert got.effective_prompt_tokens == ref.effective_prompt_tokens < ref.prompt_tokens
        assert got.output_sha256 == ref.output_sha256
        tel = got.telemetry
        assert tel.park_s == together[0].telemetry.park_s > 0 and tel.scoring_s > 0
        assert any("one drafter visit for 4 jobs" in n for n in tel.notes)
    assert_target_restored(engine, residency, original_weights)
    engine.compressor = PromptCompressor(Residency())
