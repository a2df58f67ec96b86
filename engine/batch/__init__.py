"""Many sequences per engine step: scheduler, paged KV cache, batch-invariant decode rows.

`BatchEngine` (token ids) and `generate_many` (requests in, results out as each finishes) are the
entry points; `Engine.generate_many` and `Engine.generate` call them (engine.runtime).
"""
from batchd.engine.batch.batch_engine import BatchEngine, BatchOptions
from batchd.engine.batch.generate import generate_many

__all__ = ["BatchEngine", "BatchOptions", "generate_many"]
