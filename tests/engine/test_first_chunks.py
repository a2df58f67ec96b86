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
