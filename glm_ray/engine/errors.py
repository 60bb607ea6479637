"""Errors the engine raises to its callers, each mapping to one HTTP status in the ingress."""
from __future__ import annotations


class EngineError(Exception):
    """Base class. `status_code` is what the OpenAI ingress answers with."""
    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(EngineError, ValueError):
    """The request can never be served as given (prompt longer than the context, bad params)."""
    status_code = 400
    error_type = "invalid_request_error"


class EngineOverloadedError(EngineError):
    """The waiting queue is full; the client should retry after `retry_after_s`."""
    status_code = 503
    error_type = "server_overloaded"

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineDeadError(EngineError):
    """A worker died or the engine loop crashed; the replica must be restarted."""
    status_code = 503
    error_type = "engine_dead"


class RequestFailedError(EngineError):
    """This request's step raised inside the engine (a kernel, sampling, ...); the engine goes on."""
    status_code = 500
    error_type = "engine_error"


class StepOutOfMemoryError(EngineError):
    """The device ran out of memory in this request's step; its KV was freed and the engine goes on.
    A 503: the same request may fit once the load is lower."""
    status_code = 503
    error_type = "out_of_memory"

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


def request_failure(error_type: str | None, message: str) -> EngineError:
    """The exception a failed request's stream ends with (`TokenDelta.error_type` -> class)."""
    if error_type == StepOutOfMemoryError.error_type:
        return StepOutOfMemoryError(message)
    return RequestFailedError(message)


class StepTimeoutError(RuntimeError):
    """A serving engine step ran past GLM_RAY_STEP_TIMEOUT_S (e.g. a rank stuck in a collective whose
    peer died): the engine is declared dead, its streams end with a 503 and health fails."""
