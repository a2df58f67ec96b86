"""batchd's model runtime: checkpoints, the token-id transformer, generation, speculation, PFlash.

The engine knows nothing of Redis or SQL. The service calls `Engine.load(...)` once per worker
and `Engine.generate(GenerationRequest)` per job (engine/runtime.py).
"""
from batchd.engine.errors import (BadInputError, CheckpointError, DeviceOutOfMemoryError, EngineError,
                           PromptTooLongError, UnsupportedFeatureError)
from batchd.engine.types import (CompressionOptions, GenerationRequest, GenerationResult, SamplingParams,
                          SpeculationOptions, Telemetry)

__all__ = [
    "BadInputError", "CheckpointError", "DeviceOutOfMemoryError", "EngineError", "PromptTooLongError",
    "UnsupportedFeatureError", "CompressionOptions", "GenerationRequest", "GenerationResult",
    "SamplingParams", "SpeculationOptions", "Telemetry",
]
