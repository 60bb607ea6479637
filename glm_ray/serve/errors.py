"""HTTP errors of the OpenAI API: any exception (engine errors, Ray's wrappers of them, Serve
back-pressure, dead actors) -> `APIError` with the right status, and the FastAPI handlers that make
every error leave in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`).

What a client sees is one line about what went wrong (which param, for a 4xx); nothing internal —
no traceback, exception repr, actor id, PID, address or path. A 5xx names the request id (the
`x-request-id` header) and the full exception goes to the log under that id. Every 503 carries
`Retry-After`.
"""
import functools
import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from glm_ray.engine.errors import EngineError, EngineOverloadedError, StepOutOfMemoryError
from glm_ray.serve.protocol import APIError, bad_request, format_validation_errors
from glm_ray.serve.request_context import current_request_id

logger = logging.getLogger(__name__)


def _exception_chain(exc: BaseException):
    seen = set()
    stack = [exc]
    while stack:
        e = stack.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        for nxt in (getattr(e, "cause", None), e.__cause__, e.__context__):
            if isinstance(nxt, BaseException):
                stack.append(nxt)


def map_exception(exc: BaseException) -> APIError:
    """Any exception (possibly wrapped by Ray) -> APIError with the right status."""
    chain = list(_exception_chain(exc))
    for e in chain:
        if isinstance(e, APIError):
            return e
    for e in chain:
        # Prefer the original (unwrapped) engine error: Ray's dual RayTaskError instances are
        # isinstance of the cause class but their message is the whole remote traceback.
        if isinstance(e, EngineError) and not _is_ray_wrapper(e):
            return _engine_error(e)
    for e in chain:
        if isinstance(e, EngineError):
            return _engine_error(e)
    try:
        from ray.exceptions import RayActorError  # noqa: PLC0415 - ray stays optional here (ImportError below)
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError  # noqa: PLC0415 - as above
        for e in chain:
            if isinstance(e, BackPressureError):
                headers = {}
                if e.retry_after_s:
                    headers["Retry-After"] = str(max(1, math.ceil(e.retry_after_s)))
                return APIError(e.status_code, e.message, type="server_overloaded",
                                code="server_overloaded", headers=headers)
            if isinstance(e, (DeploymentUnavailableError, RayActorError)):
                return APIError(503, "The engine is unavailable; retry later.",
                                type="service_unavailable", code="engine_unavailable")
    except ImportError:  # pragma: no cover
        pass
    return APIError(500, "Internal server error.", type="internal_error", code="internal_error")


def _is_ray_wrapper(e: BaseException) -> bool:
    try:
        from ray.exceptions import RayTaskError  # noqa: PLC0415 - ray stays optional here (ImportError below)
        return isinstance(e, RayTaskError)
    except ImportError:  # pragma: no cover
        return False


def _engine_error(e: EngineError) -> APIError:
    message = getattr(e, "message", None) or str(e)
    status = int(getattr(e, "status_code", 500) or 500)
    headers = {}
    if isinstance(e, (EngineOverloadedError, StepOutOfMemoryError)):
        retry = getattr(e, "retry_after_s", 1.0) or 1.0
        headers["Retry-After"] = str(max(1, math.ceil(retry)))
    return APIError(status, message, type=getattr(e, "error_type", None),
                    param=getattr(e, "param", None), code=getattr(e, "error_type", None),
                    headers=headers)


def for_client(err: APIError) -> APIError:
    """The error as the client gets it: a 5xx names the request id; a 503 says when to retry."""
    if err.status_code < 500:
        return err
    rid = current_request_id()
    message = err.message if not rid or rid in err.message else f"{err.message} (request id {rid})"
    headers = dict(err.headers)
    if err.status_code == 503 and not any(k.lower() == "retry-after" for k in headers):
        headers["Retry-After"] = "1"
    return APIError(err.status_code, message, type=err.type, param=err.param, code=err.code, headers=headers)


def error_response(err: APIError) -> JSONResponse:
    err = for_client(err)
    return JSONResponse(err.to_dict(), status_code=err.status_code, headers=err.headers or None)


def log_failure(what: str, exc: BaseException, err: APIError) -> None:
    """Log a failure that is not the client's, with the request id the client saw."""
    if err.status_code >= 500 and err.code != "server_overloaded":
        logger.error("%s request %s failed (%d %s)", what, current_request_id() or "-", err.status_code,
                     err.code, exc_info=exc)


def openai_errors(what: str = "request", auth: bool = False):
    """Endpoint decorator: whatever the handler raises leaves as an OpenAI error response (the status
    from `map_exception`); 5xx failures are logged with their traceback and request id.
    `auth`: the endpoint (a method with a `request: Request` argument) first calls
    `self.authorize(request)`, which raises APIError(401) for a missing or wrong API key."""
    def deco(handler):
        @functools.wraps(handler)               # keeps the signature FastAPI / Serve inspect
        async def wrapper(*args, **kwargs):
            try:
                if auth:    # Serve's class-based views pass `self` and `request` as keywords
                    owner = kwargs["self"] if "self" in kwargs else args[0]
                    owner.authorize(kwargs["request"] if "request" in kwargs
                                    else next(a for a in args if isinstance(a, Request)))
                return await handler(*args, **kwargs)
            except Exception as e:  # noqa: BLE001
                err = map_exception(e)
                log_failure(what, e, err)
                return error_response(err)
        return wrapper
    return deco


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that turn every failure into OpenAI's error shape."""
    @app.exception_handler(APIError)
    async def _api_error_handler(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error_handler(request: Request, exc: RequestValidationError):
        msg, param = format_validation_errors(list(exc.errors()))
        return error_response(bad_request(msg, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error_handler(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(APIError(exc.status_code, str(exc.detail), code=code,
                                       headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _unhandled_error_handler(request: Request, exc: Exception):
        err = map_exception(exc)
        log_failure(f"{request.method} {request.url.path}", exc, err)
        return error_response(err)
