"""ASGI middleware for Ray Serve's HTTP proxy (not our app): requests are cleaned here before the proxy
parses them.

Ray Serve 2.60's proxy takes a client's `x-request-id` header as the request id and decodes it as
UTF-8 before any app code runs; a header that is not UTF-8 (`x-request-id: Bearer \\xff`) makes the
proxy itself answer a bare 500 (found by tests/reliability's fuzzing). `SanitizeRequestId` drops an
`x-request-id` that is not 1-128 printable ASCII characters, so the proxy generates its own id.

Serve loads proxy middlewares from `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`, read by the proxy
actor's process: `glm-ray serve` sets it for the Ray it starts; with `ray start`, export
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=glm_ray.serve.proxy_middleware:proxy_middlewares` first
(deploy/serve_config.yaml, the KubeRay manifests and tests/cluster.py do).
"""
from __future__ import annotations

import re

from starlette.middleware import Middleware

ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
IMPORT_PATH = "glm_ray.serve.proxy_middleware:proxy_middlewares"
_OK_ID = re.compile(rb"[\x21-\x7e]{1,128}")


class SanitizeRequestId:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") == "http":
            headers = scope.get("headers") or []
            kept = [(k, v) for k, v in headers if k.lower() != b"x-request-id" or _OK_ID.fullmatch(v)]
            if len(kept) != len(headers):
                scope = {**scope, "headers": kept}
        await self.app(scope, receive, send)


def proxy_middlewares() -> list[Middleware]:
    """What Serve's proxy calls (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH)."""
    return [Middleware(SanitizeRequestId)]
