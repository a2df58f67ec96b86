"""A prompt's first chunk, padded as CUDA graphs replay it (engine.batch.first_chunks), on the CPU
with SmolLM2's real weights: the last row's logits and every key and value row in the pool match
the unpadded eager prefill, and the padding rows land in the spare block only."""
import pytest
import torch

from batchd.engine.batch.first_chunks import FirstChunkRunner
from batchd.engine.batch.paged_cache import PagedKVCache
from batchd.engine.kv_cache import ContiguousKVCache
from batchd.engine.runtime import Engine, EngineConfig


@pytest.fixture(scope="module")
def engine(smollm2_gguf) -> Engine:
    return Engine.load(str(smollm2_gguf), EngineConfig(device="cpu", max_context=512))


def runner_pair(engine, block_size=16, blocks=16):
    model, config = engine.model, engine.model.config
    caches = [PagedKVCache(config, blocks, block_size, model.device, model.dtype) for _ in range(2)]
    scratch = ContiguousKVCache(config, 512, model.device, model.dtype)
    eager = FirstChunkRunner(model, scratch, caches[0], padded=False)
    padded = FirstChunkRunner(model, scratch, caches[1], padded=True, granule=64)
    return eager, padded, caches


@pytest.mark.parametrize("tokens", [37, 64, 100])
def test_padded_first_chunk_matches_the_eager_prefill(engine, tokens):
    eager, padded, (eager_pool, padded_pool) = runner_pair(engine)
    assert padded.padded_length(tokens) == -(-tokens // 64) * 64 and eager.padded_length(tokens) is None
    ids = engine.codec.encode("A short document about padding. " * 20)[:tokens]
    table = [5, 2, 9, 0, 11, 7, 3][: -(-tokens // 16)]          # scattered blocks, in no order
    want = eager.run(ids, table)
    got = padded.run(ids, table)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got.argmax() == want.argmax()
    pad = eager_pool.pad_block
    for layer in (0, len(eager_pool.keys) - 1):
        for name in ("keys", "values"):
            e, p = getattr(eager_pool, name)[layer], getattr(padded_pool, name)[layer]
            for i, block in enumerate(table):
                rows = min(16, tokens - 16 * i)
                torch.testing.assert_close(p[block, :, :rows], e[block, :, :rows], rtol=1e-4, atol=1e-4)
                assert not p[block, :, rows:].any(), "a padding row landed in the sequence's block"
            untouched = [b for b in range(eager_pool.blocks.num_blocks) if b not in table]
            assert not p[untouched].any(), "a padding row landed in another sequence's block"
            assert tokens % 64 == 0 or p[pad].any(), "padding rows go to the spare block"


def test_chunks_of_one_padded_length_keep_their_own_logits(engine):
    """Two prompts of one padded length in a step: the second replays into the output buffer the
    first used, before the step samples the first one's token."""
    eager, padded, _ = runner_pair(engine)
    first = engine.codec.encode("The first document is about rivers and their deltas. " * 6)[:50]
    second = engine.codec.encode("A second text, on mountains, glaciers and snow. " * 6)[:60]
    want = eager.run(first, [0, 1, 2, 3])
    got_first = padded.run(first, [0, 1, 2, 3])
    padded.run(second, [4, 5, 6, 7])
    torch.testing.assert_close(got_first, want, rtol=1e-4, atol=1e-4)


def test_padded_first_chunks_in_the_batch_engine_keep_ids_alone_and_together(engine):
    """Short prompts of a few padded lengths, several in one step, through the batch engine with
    the padded first-chunk path (as on CUDA): each job's greedy ids alone equal its ids beside
    the others, in two arrival orders."""
    from batchd.engine.batch import BatchOptions
    from batchd.engine.types import GenerationRequest, SamplingParams

    texts = ["Rivers carry sand to the sea.", "Glaciers move slowly down a valley and carve it.",
             "The committee met on Tuesday to discuss the budget for next year.", "Bees make honey.",
             "A short story: once upon a time a fox found a well and looked into it for a long time."]
    prompts = [engine.codec.encode(t) for t in texts]

    def run(order):
        batch = engine.batch_engine(BatchOptions(block_size=16, max_step_tokens=512))
        batch.first_chunks = FirstChunkRunner(engine.model, engine.cache, batch.cache, padded=True, granule=16)
        seqs = {i: batch.submit(prompts[i], GenerationRequest(sampling=SamplingParams(max_new_tokens=5)))
                for i in order}
        while batch.has_work:
            batch.step()
        return {i: s.generated for i, s in seqs.items()}

    together, backwards = run(range(5)), run(reversed(range(5)))
    assert {len(p) // 16 for p in prompts} != {len(prompts[0]) // 16}   # several padded lengths
    for i in range(5):
        alone = run([i])[i]
        assert alone == together[i] == backwards[i], i
