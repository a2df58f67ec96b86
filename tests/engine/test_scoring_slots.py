"""PFlash scoring of several prompts in one padded forward (PaddedScorer's slots, CUDA's path, run
here eagerly): a prompt's scores have the same bits in any slot, beside any neighbours, however
many prompts wait, and are the one-slot forward's within float error; PromptCompressor's
scoring_slots gives each job the compressed ids it gets alone. A tiny random drafter on the CPU."""
from __future__ import annotations

import random

import pytest
import torch

from batchd.engine.config import ModelConfig
from batchd.engine.model import build_model
from batchd.engine.pflash import PADDED_SCORING_MAX, CompressJob, PromptCompressor
from batchd.engine.pflash.scoring import PaddedScorer
from batchd.engine.residency import DrafterError, Residency
from batchd.engine.types import CompressionOptions, Telemetry

BUCKET = 64


@pytest.fixture(scope="module")
def model():
    config = ModelConfig("llama", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=128)
    return build_model(config, "cpu", torch.float32, seed=0)


def prompts(n: int, seed: int, lengths=(70, 128)) -> list[list[int]]:
    """n random prompts, all of one padded length (two buckets) unless `lengths` spans more."""
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def test_a_prompt_scores_the_same_in_any_slot_beside_any_neighbours(model):
    scorer = PaddedScorer(model, bucket=BUCKET, slots=4)
    [mine] = prompts(1, seed=0)
    alone = scorer.score(mine)   # slot 0, the other three slots padding
    for neighbours in (prompts(3, seed=1), prompts(3, seed=2)):
        for slot in (0, 3):
            together = scorer.score_many(neighbours[:slot] + [mine] + neighbours[slot:])
            assert torch.equal(together[slot], alone), (slot, neighbours[0][:4])


@pytest.mark.parametrize("waiting", [1, 3, 4, 5, 9])
def test_a_prompt_scores_the_same_however_many_prompts_wait(model, waiting):
    scorer = PaddedScorer(model, bucket=BUCKET, slots=4)
    others = prompts(waiting - 1, seed=waiting)   # of its padded length: they share its forwards
    [mine] = prompts(1, seed=0)
    at = waiting // 2
    together = scorer.score_many(others[:at] + [mine] + others[at:])
    assert torch.equal(together[at], scorer.score(mine))
    for ids, scores in zip(others, together[:at] + together[at + 1:]):
        assert scores.shape == (len(ids),)


def test_one_slot_score_many_is_score_bit_for_bit(model):
    scorer = PaddedScorer(model, bucket=BUCKET)
    waiting = prompts(5, seed=3, lengths=(20, 200))
    for ids, scores in zip(waiting, scorer.score_many(waiting)):
        assert torch.equal(scores, scorer.score(ids))


def test_four_slots_are_the_one_slot_scores_within_float_error(model):
    waiting = prompts(6, seed=4, lengths=(20, 200))
    one = PaddedScorer(model, bucket=BUCKET).score_many(waiting)
    four = PaddedScorer(model, bucket=BUCKET, slots=4).score_many(waiting)
    for a, b in zip(one, four):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_forwards_group_prompts_by_padded_length_slots_at_a_time(model):
    scorer = PaddedScorer(model, bucket=BUCKET, slots=2)
    assert scorer.forwards([10, 100, 20, 30, 120, 64]) == [[0, 2], [3, 5], [1, 4]]


@pytest.mark.parametrize("slots", [0, -1, 2.5, True, "4"])
def test_a_bad_slots_value_is_refused(model, slots):
    with pytest.raises(ValueError, match="whole number >= 1"):
        PaddedScorer(model, slots=slots)
    with pytest.raises(ValueError, match="scoring_slots must be a whole number >= 1"):
        PromptCompressor(scoring_slots=slots)


def test_the_fingerprint_names_slots_other_than_one():
    from batchd.engine.pflash import scoring_window_key

    assert scoring_window_key(PromptCompressor()) == "w8192-b4096-s128"
    assert scoring_window_key(PromptCompressor(scoring_slots=4)) == "w8192-b4096-s128-slots4"
    assert scoring_window_key(PromptCompressor(scoring_window=None, scoring_slots=2)) == "exact-slots2"


# ---- PromptCompressor.compress_many through the padded scorer -------------------------------------

@pytest.fixture(scope="module")
def engine():
    from batchd.engine.runtime import Engine, EngineConfig
    from tests.engine.test_pflash_helpers import smollm2_folder

    return Engine.load(str(smollm2_folder()), EngineConfig(max_context=2048))


@pytest.fixture(scope="module")
def drafter_path(tmp_path_factory) -> str:
    from tests.engine.test_pflash_helpers import smollm2_tokenizer_json, tiny_drafter

    return str(tiny_drafter(tmp_path_factory.mktemp("drafter"), smollm2_tokenizer_json()))


@pytest.fixture
def padded_on_cpu(monkeypatch):
    """The padded scorer for every exact prompt, as on CUDA (the CPU's own choice is the chunked path);
    -> the prompts of each score_many call (the compressor makes one a forward)."""
    calls: list[int] = []
    score_many = PaddedScorer.score_many

    def counted(self, many):
        calls.append(len(many))
        return score_many(self, many)

    monkeypatch.setattr(PromptCompressor, "_graphed",
                        lambda self, drafter, tokens: self.tail_rows < tokens <= PADDED_SCORING_MAX)
    monkeypatch.setattr(PaddedScorer, "score_many", counted)
    return calls


def compressing_jobs(engine, drafter_path: str, words: list[int]) -> list[CompressJob]:
    from tests.engine.test_pflash_helpers import long_paper_text

    text = long_paper_text().split(" ")
    options = CompressionOptions(mode="always", keep_ratio=0.3, drafter_path=drafter_path)
    return [CompressJob(engine.codec.encode(" ".join(text[i * 700 : i * 700 + n]) + "\n\nWhat is this about?"), options,
                        Telemetry()) for i, n in enumerate(words)]


def test_compress_many_with_slots_gives_each_job_its_ids_alone(engine, drafter_path, padded_on_cpu):
    engine.compressor = PromptCompressor(Residency(), scoring_slots=4)
    words = [150, 200, 250, 120, 600]   # four prompts of one padded length, one of another
    together = engine.compressor.compress_many(engine, compressing_jobs(engine, drafter_path, words))
    assert padded_on_cpu == [4, 1]   # one forward a padded length
    jobs = compressing_jobs(engine, drafter_path, words)
    for job, shared in zip(jobs, together):
        [alone] = engine.compressor.compress_many(engine, [job])
        assert alone.ids == shared.ids and len(alone.ids) < len(job.prompt_ids)
        assert job.telemetry.compressed and job.telemetry.scoring_s > 0


def test_a_job_whose_forward_fails_fails_alone(engine, drafter_path, padded_on_cpu, monkeypatch):
    engine.compressor = PromptCompressor(Residency(), scoring_slots=4)
    jobs = compressing_jobs(engine, drafter_path, [150, 200, 250])
    others = set(jobs[0].prompt_ids + jobs[2].prompt_ids)
    mark = next(token for token in jobs[1].prompt_ids if token not in others)   # the second prompt's own
    score_forward = PaddedScorer._score_forward

    def failing(self, many):
        if any(mark in ids for ids in many):
            raise RuntimeError("a bad prompt")
        return score_forward(self, many)

    monkeypatch.setattr(PaddedScorer, "_score_forward", failing)
    out = engine.compressor.compress_many(engine, jobs)
    assert padded_on_cpu == [3, 1, 1, 1]   # together, then each alone to find whose prompt failed
    assert isinstance(out[1], DrafterError) and "a bad prompt" in str(out[1])
    assert not isinstance(out[0], Exception) and not isinstance(out[2], Exception)
