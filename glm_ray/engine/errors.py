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
