"""Typed errors a user can cause. Mapped once in the CLI and once in the server."""

from __future__ import annotations


class MlxbError(Exception):
    """Base class; ``message`` says what went wrong and what to do next."""

    status = 400  # HTTP status used by the server
    kind = "invalid_request_error"  # OpenAI error type
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class ModelNotFoundError(MlxbError):
    status = 404
    code = "model_not_found"


class ValidationError(MlxbError):
    code = "invalid_value"


class ContextLimitError(MlxbError):
    code = "context_length_exceeded"


class KVBudgetError(MlxbError):
    code = "kv_budget_exceeded"


class EngineUnavailableError(MlxbError):
    status = 503
    kind = "server_error"
    code = "engine_unavailable"


class EngineFailure(MlxbError):
    """The device step failed; every row of that batch gets this."""

    status = 500
    kind = "server_error"
    code = "engine_failure"


class NotImplementedYet(MlxbError):
    code = "not_implemented"
