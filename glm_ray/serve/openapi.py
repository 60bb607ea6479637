"""The published OpenAPI schema of the ingress (`/openapi.json`, rendered at `/docs`).

The endpoints read their bodies themselves (`protocol.parse_body`: size, depth, finite numbers, valid
Unicode before pydantic), so FastAPI cannot infer their schemas. `build_openapi` adds them: each
route's request body is the pydantic model `parse_body` validates against (so the bounds of
`engine.sampling_params.BOUNDS` appear as minimum/maximum), its 200 is the response model (plus
`text/event-stream` where `stream: true` is allowed), and every status the endpoint can answer with
is listed with OpenAI's error body; 503s document `Retry-After`. What depends on the deployment
(the model id clients must send, the vocabulary for token ids) is filled in per replica.
"""
from __future__ import annotations

from typing import Any

from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from glm_ray.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from glm_ray.serve.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)

_REF = "#/components/schemas/{model}"
_STATUS_TEXT = {400: "Invalid request (OpenAI error shape; `param` names the field)",
                401: "Missing or wrong API key (only when the server has one)",
                404: "Unknown model or path", 405: "Method not allowed",
                413: "Request body too large",
                500: "Internal error (the message names the request id, see `x-request-id`)",
                503: "Overloaded, out of memory, or the engine is restarting: retry after `Retry-After` seconds"}


class Route:
    """What one (path, method) takes and answers."""

    def __init__(self, request: Any, response: type[BaseModel] | None, errors: tuple[int, ...],
                 streams: bool = False, auth: bool = False):
        self.request, self.response, self.errors, self.streams, self.auth = request, response, errors, streams, auth


_GENERATE_ERRORS = (400, 404, 413, 500, 503)
ROUTES: dict[tuple[str, str], Route] = {
    ("/v1/completions", "post"): Route(CompletionRequest, CompletionResponse, _GENERATE_ERRORS, True, True),
    ("/v1/chat/completions", "post"): Route(ChatCompletionRequest, ChatCompletionResponse, _GENERATE_ERRORS,
                                            True, True),
    ("/tokenize", "post"): Route((TokenizeCompletionRequest, TokenizeChatRequest), TokenizeResponse,
                                 (400, 404, 413, 500, 503)),
    ("/detokenize", "post"): Route(DetokenizeRequest, DetokenizeResponse, (400, 404, 413, 500, 503)),
    ("/v1/models", "get"): Route(None, ModelList, (500, 503), auth=True),
    ("/v1/models/{model_id}", "get"): Route(None, ModelCard, (404, 500, 503), auth=True),
    ("/health", "get"): Route(None, None, (503,)),
    ("/version", "get"): Route(None, None, ()),
}


def build_openapi(routes, *, title: str, version: str, model_name: str | None = None,
                  vocab_size: int | None = None, auth: bool = False,
                  request_chat_template: bool = False) -> dict[str, Any]:
    schema = get_openapi(title=title, version=version, routes=routes)
    models: list[type[BaseModel]] = [ErrorResponse]
    for r in ROUTES.values():
        models += list(r.request) if isinstance(r.request, tuple) else [r.request] if r.request else []
        models += [r.response] if r.response else []
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(defs.get("$defs", {}))
    _specialize(components, model_name, vocab_size, request_chat_template)
    for (path, method), route in ROUTES.items():
        op = schema.get("paths", {}).get(path, {}).get(method)
        if op is None:
            continue
        if route.request is not None:
            reqs = route.request if isinstance(route.request, tuple) else (route.request,)
            refs = [{"$ref": _REF.format(model=m.__name__)} for m in reqs]
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}}}
        op["responses"] = _responses(route, auth)
    return schema


def _responses(route: Route, auth: bool) -> dict[str, Any]:
    ok: dict[str, Any] = {"description": "OK"}
    if route.response is not None:
        ok["content"] = {"application/json": {"schema": {"$ref": _REF.format(model=route.response.__name__)}}}
        if route.streams:
            # OpenAPI < 3.2: `schema` describes one event; each carries a JSON chunk (or [DONE]) as data
            ok["content"]["text/event-stream"] = {"schema": {"type": "object", "required": ["data"],
                                                             "properties": {"data": {"type": "string"}}}}
    out = {"200": ok}
    errors = set(route.errors) | ({401} if auth and route.auth else set())
    error_body = {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}
    for code in sorted(errors):
        entry: dict[str, Any] = {"description": _STATUS_TEXT[code], "content": error_body}
        if code == 503:
            entry["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "required": True,
                                                "description": "seconds to wait before retrying"}}
        out[str(code)] = entry
    return out


def _specialize(components: dict[str, Any], model_name: str | None, vocab_size: int | None,
                request_chat_template: bool) -> None:
    """Per deployment: `model` is the served id; token ids are below the vocabulary size; a request-level
    `chat_template` only where the server trusts them."""
    for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeCompletionRequest", "TokenizeChatRequest",
                 "DetokenizeRequest"):
        props = components.get(name, {}).get("properties", {})
        if "chat_template" in props and not request_chat_template:
            props["chat_template"] = {"type": "null", "default": None, "title": "Chat Template",
                                      "description": "refused: the server runs without "
                                                     "--trust-request-chat-template"}
        if model_name and "model" in props:
            # "" or null = the served model (vLLM accepts an empty name too); any other name is a 404
            props["model"] = {"anyOf": [{"type": "string", "enum": [model_name, ""]}, {"type": "null"}],
                              "title": "Model", "default": None,
                              "description": "the served model id; empty or null means the same"}
        if vocab_size:
            for field in ("prompt", "stop_token_ids", "tokens"):
                if field in props:
                    _cap_token_ids(props[field], vocab_size - 1)


def _cap_token_ids(node: Any, hi: int) -> None:
    """Every integer with the token-id bounds (minimum 0, maximum INT32_MAX) gets maximum `hi`."""
    if isinstance(node, dict):
        if node.get("type") == "integer" and node.get("minimum") == 0 and node.get("maximum") == 2**31 - 1:
            node["maximum"] = hi
        for v in node.values():
            _cap_token_ids(v, hi)
    elif isinstance(node, list):
        for v in node:
            _cap_token_ids(v, hi)
