"""HTTP errors of the OpenAI API: any exception (engine errors, Ray's wrappers of them, Serve
back-pressure, dead actors) -> `APIError` with the right status, and the FastAPI handlers that make
every error leave in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`)."""
import functools
import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from glm_ray.engine.errors import EngineError, EngineOverloadedError
from glm_ray.serve.protocol import APIError, bad_request, format_validation_errors

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
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
        from ray.exceptions import RayActorError
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
    msg = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    return APIError(500, f"Internal server error: {msg}", type="internal_error", code="internal_error")


def _is_ray_wrapper(e: BaseException) -> bool:
    try:
        from ray.exceptions import RayTaskError
        return isinstance(e, RayTaskError)
    except ImportError:  # pragma: no cover
        return False


def _engine_error(e: EngineError) -> APIError:
    message = getattr(e, "message", None) or str(e)
    status = int(getattr(e, "status_code", 500) or 500)
    headers = {}
    if isinstance(e, EngineOverloadedError):
        retry = getattr(e, "retry_after_s", 1.0) or 1.0
        headers["Retry-After"] = str(max(1, math.ceil(retry)))
    return APIError(status, message, type=getattr(e, "error_type", None),
                    param=getattr(e, "param", None), code=getattr(e, "error_type", None),
                    headers=headers)


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.to_dict(), status_code=err.status_code, headers=err.headers or None)


def openai_errors(what: str | None = None):
    """Endpoint decorator: whatever the handler raises leaves as an OpenAI error response (the status
    from `map_exception`); failures that are not the client's (`what` set) are also logged."""
    def deco(handler):
        @functools.wraps(handler)               # keeps the signature FastAPI / Serve inspect
        async def wrapper(*args, **kwargs):
            try:
                return await handler(*args, **kwargs)
            except Exception as e:  # noqa: BLE001
                if what is not None and not isinstance(e, APIError):
                    logger.warning("%s request failed: %r", what, e)
                return error_response(map_exception(e))
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
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(map_exception(exc))
