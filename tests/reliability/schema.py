"""schemathesis over the app's published OpenAPI schema: which checks run, positive bodies clamped
to small generations, one run per operation."""

import json
from typing import Any

import requests

from tests.reliability.client import _assert_loopback

# ------------------------------------------------------------------------------------------------
# schemathesis over the app's OpenAPI schema
# ------------------------------------------------------------------------------------------------

# Bodies schemathesis generates for the generation endpoints are clamped to a short generation in
# *positive* mode only (a schema-valid request may ask for the whole context, minutes on CPU):
# max_tokens/max_completion_tokens <= 8 (set when absent), n/best_of <= 4, min_tokens <= max_tokens.
# A clamped body is still schema-valid. Negative bodies are sent as generated.
GENERATION_PATHS = {"/v1/completions", "/v1/chat/completions"}
CLAMP_TOKENS = 8


def clamp_positive_body(path: str, body: Any) -> Any:
    """A schema-valid generation body made short (max_tokens <= 8, n <= 4) and consistent with the
    relations between fields that JSON Schema cannot state, each a documented 400 of the server:
    min_tokens <= max_tokens, best_of == n, top_logprobs only with logprobs: true,
    add_generation_prompt and continue_final_message not both true, unique tool names, tool_choice naming
    a given tool ("required" only with tools), earlier tool calls' arguments JSON objects, no min_tokens with structured outputs
    (a non-text response_format, or tool_choice "required" / a named function with tools), and not
    both of those."""
    if path not in GENERATION_PATHS or not isinstance(body, dict):
        return body
    # JSON integers may come as integral floats (817.0): the server takes them as integers, so do we
    body = {k: int(v) if isinstance(v, float) and v.is_integer() and abs(v) < 2**63 else v for k, v in body.items()}
    if body.get("top_logprobs") is not None and path == "/v1/chat/completions":
        body["logprobs"] = True
    if body.get("add_generation_prompt", True) and body.get("continue_final_message"):
        body["continue_final_message"] = False
    mt_keys = [k for k in ("max_tokens", "max_completion_tokens") if k in body] or ["max_tokens"]
    for k in mt_keys:
        v = body.get(k)
        if v is None or (isinstance(v, int) and not isinstance(v, bool) and v > CLAMP_TOKENS):
            body[k] = CLAMP_TOKENS
    ints = [body[k] for k in mt_keys if isinstance(body.get(k), int) and not isinstance(body.get(k), bool)]
    limit = min(ints) if ints else CLAMP_TOKENS
    for k in ("n", "best_of"):
        v = body.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 4:
            body[k] = 4
    if body.get("best_of") is not None:
        body["best_of"] = body.get("n") or 1
    v = body.get("min_tokens")
    if isinstance(v, int) and not isinstance(v, bool) and v > limit:
        body["min_tokens"] = limit
    tools = body.get("tools")
    if isinstance(tools, list):                   # function names are unique; tool_choice names one of them
        seen, kept = set(), []
        for t in tools:
            name = ((t or {}).get("function") or {}).get("name") if isinstance(t, dict) else None
            if name not in seen:
                seen.add(name)
                kept.append(t)
        body["tools"] = kept
    names = {((t or {}).get("function") or {}).get("name") for t in body.get("tools") or [] if isinstance(t, dict)}
    tc = body.get("tool_choice")
    if (isinstance(tc, dict) and (tc.get("function") or {}).get("name") not in names) or \
            (tc == "required" and not body.get("tools")):
        body.pop("tool_choice")
    for m in body.get("messages") or []:         # earlier tool calls' arguments: a string holding an object
        for tc in (m.get("tool_calls") or []) if isinstance(m, dict) and isinstance(m.get("tool_calls"), list) else []:
            fn = tc.get("function") if isinstance(tc, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    ok = isinstance(json.loads(fn["arguments"]), dict)
                except ValueError:
                    ok = False
                if not ok:
                    fn["arguments"] = "{}"
    rf = body.get("response_format")
    formatted = isinstance(rf, dict) and rf.get("type") in ("json_object", "json_schema")
    tc = body.get("tool_choice")
    forced_tool = bool(body.get("tools")) and (tc == "required" or isinstance(tc, dict))
    if formatted and forced_tool:
        body["tool_choice"] = "auto"
        forced_tool = False
    if (formatted or forced_tool) and body.get("min_tokens"):
        body["min_tokens"] = 0
    return body


def schema_problems(schema: dict) -> list[str]:
    """What the OpenAPI document fails to describe (read from the document itself)."""
    problems = []
    paths = schema.get("paths", {})
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/models", "/health"):
        if path not in paths:
            problems.append(f"{path}: not in the schema")
    for path, ops in paths.items():
        for method, op in ops.items():
            if method not in ("get", "post", "put", "delete", "patch"):
                continue
            label = f"{method.upper()} {path}"
            codes = set(op.get("responses", {}))
            if method == "post":
                rb = op.get("requestBody")
                content = (rb or {}).get("content", {})
                if not rb or "application/json" not in content or not content["application/json"].get("schema"):
                    problems.append(f"{label}: no application/json requestBody schema")
                if "400" not in codes and "4XX" not in codes:
                    problems.append(f"{label}: 400 not documented")
            if "422" in codes:
                problems.append(f"{label}: documents 422 (the server answers 400 for invalid input)")
            if path in GENERATION_PATHS and "503" not in codes and "5XX" not in codes:
                problems.append(f"{label}: 503 (overloaded / engine unavailable) not documented")
    return problems


def schemathesis_checks() -> list:
    """not_a_server_error, status_code_conformance, content_type_conformance,
    response_schema_conformance, response_headers_conformance, negative_data_rejection,
    positive_data_acceptance. Not used: max_response_time (no latency target here), the stateful
    checks (use_after_free, ensure_resource_availability: the API has no resources to create or
    delete), ignored_auth/missing_required_header (no security scheme in the default app), and
    unsupported_method (run by the hostile generator's method catalog instead)."""
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        positive_data_acceptance,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )
    return [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
            response_headers_conformance, negative_data_rejection, positive_data_acceptance]


def load_schema(base_url: str):
    import schemathesis
    _assert_loopback(base_url)
    return schemathesis.openapi.from_url(base_url.rstrip("/") + "/openapi.json", timeout=30)


def run_schemathesis_operation(schema, base_url: str, label: str, max_examples: int = 10, seed: int = 0,
                               timeout: float = 60.0) -> dict:
    """Positive and negative cases for one operation ("POST /v1/completions"); every check runs on
    every response; failures are collected (the first example per check), not raised, so one run
    reports everything that is wrong with the operation."""
    import hypothesis
    from hypothesis import HealthCheck, Phase, settings
    from schemathesis.core.failures import FailureGroup
    from schemathesis.generation import GenerationMode

    _assert_loopback(base_url)
    method, path = label.split(" ", 1)
    op = schema[path][method]
    checks = schemathesis_checks()
    out = {"operation": label, "cases": {}, "failures": {}, "notes": []}
    session = requests.Session()
    too_long = [0]
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        count = [0]

        @hypothesis.seed(seed)
        @settings(max_examples=max_examples, deadline=None, database=None, derandomize=False,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate],
                  print_blob=False)
        @hypothesis.given(case=op.as_strategy(generation_mode=mode))
        def run(case):
            if mode == GenerationMode.POSITIVE and path in GENERATION_PATHS and isinstance(case.body, dict):
                case.body = clamp_positive_body(path, case.body)
            count[0] += 1
            try:
                response = case.call(base_url=base_url, session=session, timeout=timeout)
            except requests.RequestException as e:
                out["failures"].setdefault(f"{mode.value}:no_response", {"error": repr(e)[:300],
                                                                         "body": _short(case.body)})
                return
            try:
                case.validate_response(response, checks=checks)
            except FailureGroup as group:
                for f in group.exceptions:
                    if type(f).__name__ == "RejectedPositiveData" and _too_long(response):
                        too_long[0] += 1     # the rendered prompt outgrew the context: no schema can say so
                        continue
                    key = f"{mode.value}:{type(f).__name__}"
                    out["failures"].setdefault(key, {
                        "title": f.title, "message": f.message[:300], "status": response.status_code,
                        "body": _short(case.body), "response": response.text[:300]})
            except AssertionError as e:
                out["failures"].setdefault(f"{mode.value}:{type(e).__name__}", {"message": str(e)[:300]})

        try:
            run()
        except hypothesis.errors.Unsatisfiable:
            out["notes"].append(f"{mode.value}: no {mode.value} case can be generated "
                                f"(nothing in the schema of {label} to {'negate' if mode.value == 'negative' else 'vary'})")
        out["cases"][mode.value] = count[0]
    if too_long[0]:
        out["notes"].append(f"{too_long[0]} schema-valid bodies rendered past the context (400 "
                            f"context_length_exceeded), not counted as rejected")
    return out


def _too_long(response) -> bool:
    """A 400 saying the prompt leaves no room in the model's context (OpenAI's context_length_exceeded)."""
    if response.status_code != 400:
        return False
    try:
        return response.json()["error"]["code"] == "context_length_exceeded"
    except (ValueError, KeyError, TypeError):
        return False


def _short(body: Any, limit: int = 300) -> str:
    try:
        s = json.dumps(body, default=str)
    except (TypeError, ValueError):
        s = repr(body)
    return s[:limit]


def run_schemathesis(base_url: str, max_examples: int = 10, seed: int = 0, timeout: float = 60.0) -> dict:
    schema_doc = requests.get(base_url.rstrip("/") + "/openapi.json", timeout=30).json()
    schema = load_schema(base_url)
    ops = []
    for res in schema.get_all_operations():
        op = res.ok()
        ops.append(f"{op.method.upper()} {op.path}")
    results = [run_schemathesis_operation(schema, base_url, label, max_examples, seed, timeout) for label in ops]
    return {"schema_problems": schema_problems(schema_doc), "operations": results,
            "cases": sum(sum(r["cases"].values()) for r in results),
            "failing_checks": sum(len(r["failures"]) for r in results)}


