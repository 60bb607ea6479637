"""Who is asking: the request id a client can quote, and the API-key check.

- `current_request_id()`: Ray Serve's id of the HTTP request being handled — the `X-Request-ID` header
  that Serve's proxy puts on every response (a client may send its own) and the `request_id` of
  Serve's replica logs. 5xx messages name it and the log line holding the traceback carries it, so
  what a client reports leads to the cause. Engine request ids are our own (`cmpl-<hex>-<choice>`),
  never the client's, so two clients sending the same X-Request-ID cannot collide in the engine.
- `bearer_ok`: the check the /v1/* endpoints make when a key is configured (`api_key` app argument /
  `--api-key` / `GLM_RAY_API_KEY`; vLLM's rule: /health, /tokenize, /detokenize, /version, /docs and
  /openapi.json stay open).
"""
from __future__ import annotations

import hmac


def current_request_id() -> str:
    try:
        from ray.serve.context import _get_serve_request_context  # noqa: PLC0415 - ray, only in a Serve replica
        return _get_serve_request_context().request_id or ""
    except Exception:  # noqa: BLE001 - outside a Serve replica (unit tests)
        return ""


def bearer_ok(authorization: str | None, key: str) -> bool:
    """`Authorization: Bearer <key>` carries `key` (constant-time compare)."""
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())
