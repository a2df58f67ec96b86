"""Errors the engine raises for a job's input or for its checkpoints.

Every error carries a `kind` (the column `error_kind` of a failed job, docs/design.md section 1) and
whether retrying can help. The message is written for a person: it says what to do.
Bugs are not EngineErrors; they propagate as ordinary exceptions with a traceback.
"""
from __future__ import annotations


class EngineError(Exception):
    kind: str = "internal"
    retryable: bool = False

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class BadInputError(EngineError, ValueError):
    """The job's prompt or parameters are unusable (empty, not UTF-8, invalid params)."""

    kind = "bad_input"


class PromptTooLongError(EngineError, ValueError):
    """The prompt plus max_new_tokens does not fit the model's context."""

    kind = "too_long"


class CheckpointError(EngineError):
    """A checkpoint is missing, truncated, corrupt, of an unknown architecture or of wrong shape."""

    kind = "model_error"


class UnsupportedFeatureError(EngineError, ValueError):
    """The feature gate refused an option for this architecture or placement."""

    kind = "bad_input"


class DeviceOutOfMemoryError(EngineError):
    kind = "oom"
    retryable = True


class InternalError(EngineError):
    """A bug met while running a job (the worker log has the traceback); the job fails, the worker goes on."""

    kind = "internal"
