"""The reliability harness, shared by the CI tests (tests/reliability/test_*.py) and the long run
(scripts/reliability.py): a seeded hostile-request generator, the response checker, and the scenario
runners (fuzz, 4x KV overload, disconnect storm, injected step faults, worker kill, soak).

Every request goes to 127.0.0.1 (the apps of tests/cluster.py); every loop is bounded in count and
in time. Each runner returns a plain dict (JSON-able) with its measured values; `figure()` turns
one into the line the long script prints (value, target, PASS/FAIL).

The contract checked (issue 15, "No request can take the server down"):
- no 5xx, except 503 that carries Retry-After (overload, engine restarting);
- 4xx/5xx bodies in OpenAI's shape {"error": {"message", "type", "param", "code"}}, one-line message;
  422 never (it is 400);
- no internals in any error text: tracebacks, ANSI escapes, Ray task/actor names and ids, pids, file
  paths, IP addresses;
- every response carries x-request-id; a 500 names it in its message;
- afterwards /health is 200 and a normal request succeeds.
"""
from __future__ import annotations

import concurrent.futures as cf
import copy
import http.client
import json
import math
import random
import re
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional
from urllib.parse import urlsplit

import requests

from tests.reliability.apps import EXCEPTION_TOKEN, FAULT_TOKENS, OOM_TOKEN, SAMPLE_TOKEN

# ------------------------------------------------------------------------------------------------
# The response checker
# ------------------------------------------------------------------------------------------------

# Internals that must never reach a client (the issue's list). Matched case-sensitively except where
# noted; ".py" only as a file name (a word char before it), so "a.pyramid" in echoed input is no hit.
LEAK_PATTERNS: list[tuple[str, re.Pattern]] = [
    ("traceback", re.compile(r"Traceback")),
    ("file path", re.compile(r'File "')),
    ("ANSI escape", re.compile(r"\x1b\[")),
    ("ray task name", re.compile(r"ray::")),
    ("RayTaskError", re.compile(r"RayTaskError|RayActorError|ActorDiedError")),
    ("actor id", re.compile(r"ActorID|actor_id", re.IGNORECASE)),
    ("pid", re.compile(r"pid=")),
    (".py file", re.compile(r"\w\.py\b")),
    ("site-packages", re.compile(r"site-packages")),
    ("IP address", re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w.])")),
]

ERROR_FIELDS = ("message", "type", "param", "code")
# The 503s that mean "busy, retry" (queue full, Serve back-pressure, an OOM in a step). A 503 of an
# engine that is down (engine_dead / engine_unavailable / engine_unhealthy) is no such answer: where no
# worker was killed, it means a request took the server down.
OVERLOAD_CODES = frozenset({"server_overloaded", "out_of_memory"})


def leaks(text: str) -> list[str]:
    """Names of the internals found in `text` (raw, and as JSON-decoded strings: an ANSI escape
    travels as \\u001b inside JSON)."""
    texts = [text]
    try:
        texts += list(_strings(json.loads(text)))
    except (ValueError, RecursionError):
        pass
    return [name for name, pat in LEAK_PATTERNS if any(pat.search(t) for t in texts)]


def _strings(obj: Any, depth: int = 0):
    if depth > 50:
        return
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield str(k)
            yield from _strings(v, depth + 1)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v, depth + 1)


@dataclass
class HostileRequest:
    kind: str                               # category, e.g. "nan:temperature", "nesting:messages"
    method: str
    path: str                               # relative to the app's base url
    body: Optional[bytes] = None
    headers: dict = field(default_factory=dict)
    expect: Optional[frozenset] = None      # statuses that are right; None: any non-5xx
    note: str = ""
    # False: not a valid HTTP request, so the proxy's HTTP parser answers before the app: only "no
    # 5xx, no leaks" applies (no OpenAI shape, no x-request-id)
    app_level: bool = True

    def describe(self, limit: int = 160) -> str:
        b = self.body or b""
        shown = b[:limit].decode("utf-8", "backslashreplace")
        more = f"... ({len(b)} bytes)" if len(b) > limit else ""
        ct = self.headers.get("content-type", "-")
        return f"[{self.kind}] {self.method} {self.path} ct={ct} body={shown}{more}"


@dataclass
class Reply:
    status: Optional[int]                    # None: no HTTP response (connection error, timeout)
    headers: dict                            # lower-cased names
    body: bytes
    elapsed: float
    transport_error: Optional[str] = None

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.body)


def sse_events(body: bytes) -> tuple[list[Any], bool]:
    """(parsed `data:` events, whether the stream ended with `data: [DONE]`)."""
    events, done = [], False
    for line in body.decode("utf-8", "replace").splitlines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            continue
        try:
            events.append(json.loads(data))
        except ValueError:
            events.append({"_unparsable": data[:200]})
    return events, done


def check_error_body(reply: Reply) -> list[str]:
    """Problems with an error body's shape (OpenAI's) and content (one line, no internals)."""
    problems = []
    try:
        obj = reply.json()
    except ValueError:
        return [f"error body is not JSON: {reply.text[:200]!r}"]
    err = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(err, dict) or any(k not in err for k in ERROR_FIELDS):
        return [f"error body not in OpenAI shape: {reply.text[:200]!r}"]
    if not isinstance(err["message"], str) or not err["message"]:
        problems.append("error.message is not a non-empty string")
    elif "\n" in err["message"] or "\r" in err["message"]:
        problems.append(f"error.message spans lines: {err['message'][:200]!r}")
    if not isinstance(err["type"], str) or not err["type"]:
        problems.append("error.type is not a non-empty string")
    ct = reply.headers.get("content-type", "")
    if not ct.startswith("application/json"):
        problems.append(f"error content-type {ct!r}")
    return problems


def check_reply(req: Optional[HostileRequest], reply: Reply, *, allow_stream_errors: bool = False,
                busy_codes: Optional[frozenset] = OVERLOAD_CODES) -> list[str]:
    """Everything wrong with one response (empty list: fine). A 503 must carry Retry-After and,
    unless `busy_codes` is None, one of those error codes."""
    if reply.status is None:
        return [f"no response: {reply.transport_error}"]
    problems = []
    s = reply.status
    app_level = req is None or req.app_level
    if app_level and "x-request-id" not in reply.headers:
        problems.append("no x-request-id header")
    if s == 422:
        problems.append("422 (the contract: invalid input is 400)")
    if s >= 500 and not (s == 503 and _retry_after_ok(reply.headers)):
        problems.append(f"server error {s}" + (" (503 without a valid Retry-After)" if s == 503 else ""))
    elif s == 503 and busy_codes is not None and _error_code(reply) not in busy_codes:
        problems.append(f"server error 503 of a server that is down (code {_error_code(reply)!r}, not one of "
                        f"{sorted(busy_codes)})")
    if req is not None and req.expect is not None and s not in req.expect:
        problems.append(f"status {s}, expected {sorted(req.expect)}")
    if s >= 400:
        if app_level and not (req is not None and req.method == "HEAD"):     # a HEAD answer has no body
            problems += check_error_body(reply)
        found = leaks(reply.text)
        if found:
            problems.append(f"leaked internals {found}: {reply.text[:300]!r}")
        if s == 500:
            rid = reply.headers.get("x-request-id")
            if rid and rid not in reply.text:
                problems.append("500 whose message does not name its x-request-id")
    elif s == 200 and reply.headers.get("content-type", "").startswith("text/event-stream"):
        events, done = sse_events(reply.body)
        if not done:
            problems.append("event stream did not end with data: [DONE]")
        for ev in events:
            if isinstance(ev, dict) and "_unparsable" in ev:
                problems.append(f"unparsable SSE event {ev['_unparsable']!r}")
            elif isinstance(ev, dict) and "error" in ev:
                text = json.dumps(ev)
                found = leaks(text)
                if found:
                    problems.append(f"leaked internals in SSE error {found}: {text[:300]!r}")
                if not allow_stream_errors:
                    problems.append(f"error event in a 200 stream: {text[:300]!r}")
    return problems


def _error_code(reply: Reply) -> Any:
    try:
        err = json.loads(reply.body).get("error")
        return err.get("code") if isinstance(err, dict) else None
    except (ValueError, AttributeError, RecursionError):
        return None


def _retry_after_ok(headers: dict) -> bool:
    try:
        return float(headers.get("retry-after", "")) > 0
    except ValueError:
        return False


# ------------------------------------------------------------------------------------------------
# Sending
# ------------------------------------------------------------------------------------------------

_local = threading.local()


def _session() -> requests.Session:
    s = getattr(_local, "session", None)
    if s is None:
        s = _local.session = requests.Session()
    return s


def _assert_loopback(url: str) -> None:
    host = urlsplit(url).hostname or ""
    if not (host == "localhost" or host.startswith("127.") or host == "::1"):
        raise ValueError(f"reliability traffic goes to the loopback only, not {host!r}")


def send(base_url: str, req: HostileRequest, timeout: float = 60.0) -> Reply:
    """One request; the whole body is read (SSE too) within `timeout` seconds of read inactivity."""
    url = base_url.rstrip("/") + req.path
    _assert_loopback(url)
    t0 = time.monotonic()
    try:
        r = _session().request(req.method, url, data=req.body, headers=req.headers,
                               timeout=(5.0, timeout), allow_redirects=False)
        return Reply(r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content,
                     time.monotonic() - t0)
    except requests.RequestException as e:
        _local.session = None               # a broken connection must not be reused
        return Reply(None, {}, b"", time.monotonic() - t0, f"{type(e).__name__}: {str(e)[:200]}")


def post_json(base_url: str, path: str, body: Any, timeout: float = 120.0, kind: str = "normal") -> Reply:
    return send(base_url, HostileRequest(kind, "POST", path, dumps(body),
                                         {"content-type": "application/json"}), timeout)


def dumps(obj: Any) -> bytes:
    """JSON as Python writes it: NaN/Infinity as bare tokens, lone surrogates as \\udXXX escapes."""
    return json.dumps(obj, allow_nan=True).encode()


def completion(model: str, prompt: Any = "Hello there", max_tokens: int = 4, **kw) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, **kw}


def chat(model: str, content: Any = "Hello there", max_tokens: int = 4, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **kw}


def is_healthy(base_url: str, model: str, timeout: float = 30.0) -> tuple[bool, str]:
    """/health 200 and a normal completion 200 with its tokens."""
    h = send(base_url, HostileRequest("health", "GET", "/health"), timeout)
    if h.status != 200:
        return False, f"/health -> {h.status} {h.text[:200] or h.transport_error}"
    r = post_json(base_url, "/v1/completions", completion(model, max_tokens=2), timeout)
    try:
        ok = r.status == 200 and r.json()["usage"]["completion_tokens"] >= 1
    except (ValueError, KeyError, TypeError):
        ok = False
    return ok, f"completion -> {r.status} {r.text[:200] or r.transport_error}"


def wait_healthy(base_url: str, model: str, timeout: float = 180.0) -> float:
    """Seconds until the app serves again (bounded); raises TimeoutError with the last answer."""
    t0 = time.monotonic()
    detail = ""
    while time.monotonic() - t0 < timeout:
        try:
            ok, detail = is_healthy(base_url, model, timeout=20)
        except Exception as e:  # noqa: BLE001
            ok, detail = False, repr(e)
        if ok:
            return time.monotonic() - t0
        time.sleep(1.0)
    raise TimeoutError(f"{base_url} did not serve again within {timeout:.0f}s: {detail}")


# ------------------------------------------------------------------------------------------------
# The seeded hostile-request generator
# ------------------------------------------------------------------------------------------------

JSON = {"content-type": "application/json"}
DEPTH = 10_000

HUGE_INTS = [2**63, 2**64, 2**64 + 1, 2**100, -(2**63) - 1, -(2**64), 10**30]
NAN_TOKENS = ["NaN", "Infinity", "-Infinity"]
INT_FIELDS = ["n", "seed", "top_k", "max_tokens", "min_tokens", "prompt_logprobs", "logprobs", "best_of"]
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
CHAT_INT_FIELDS = ["n", "seed", "top_k", "max_tokens", "max_completion_tokens", "min_tokens", "top_logprobs",
                   "prompt_logprobs"]
# Body fields a mutation may not delete or set to a *valid* large value: bounds generation time
# (a chat request without max_tokens generates until the context is full: minutes on CPU).
PROTECTED = {"max_tokens", "max_completion_tokens"}


def _nested(depth: int, kind: str = "list") -> str:
    return "[" * depth + "]" * depth if kind == "list" else '{"a":' * depth + "1" + "}" * depth


def _raw(template: dict, key: str, raw_value: str) -> bytes:
    """`template` as JSON with `key` set to a raw JSON text (NaN, a 5000-digit int, deep nesting...)."""
    marker = "__RAW_VALUE_MARKER__"
    return dumps({**template, key: marker}).replace(f'"{marker}"'.encode(), raw_value.encode())


class HostileGenerator:
    """`requests(n)`: the fixed catalog (every class of hostile input the issue lists, each with the
    statuses that are right for it) followed by seeded random mutations of valid bodies for every
    endpoint. The same seed gives the same sequence."""

    def __init__(self, seed: int, model: str, vocab_size: int, max_model_len: int, big_body_mb: int = 20):
        self.seed, self.model, self.V, self.ctx = seed, model, vocab_size or 1024, max_model_len or 4096
        self.big_body_mb = big_body_mb

    # ---- valid bodies (small and quick: max_tokens <= 4) ----
    def valid(self, rng: random.Random) -> tuple[str, str, dict]:
        m = self.model
        choices = [
            ("POST", "/v1/completions", completion(m, "Hello there", 3)),
            ("POST", "/v1/completions", completion(m, [11, 12, 13, 14], 3, temperature=0.7, top_k=5, seed=7)),
            ("POST", "/v1/completions", completion(m, ["a b", "c d"], 2, n=2, logprobs=2, echo=True)),
            ("POST", "/v1/completions", completion(m, "count: 1 2 3", 4, stream=True,
                                                   stream_options={"include_usage": True})),
            ("POST", "/v1/chat/completions", chat(m, "hi", 3)),
            ("POST", "/v1/chat/completions", chat(m, "hi", 3, stream=True, logprobs=True, top_logprobs=2)),
            ("POST", "/v1/chat/completions", {"model": m, "max_completion_tokens": 2, "messages": [
                {"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "x"}]}]}),
            ("POST", "/tokenize", {"model": m, "prompt": "hello world", "return_token_strs": True}),
            ("POST", "/tokenize", {"model": m, "messages": [{"role": "user", "content": "hi"}]}),
            ("POST", "/detokenize", {"model": m, "tokens": [11, 12, 13]}),
            ("GET", "/v1/models", None),
            ("GET", f"/v1/models/{m}", None),
            ("GET", "/health", None),
        ]
        return rng.choice(choices)

    def mutated_get(self, rng: random.Random, path: str) -> HostileRequest:
        """GET endpoints: hostile query strings, path suffixes, bodies, methods and headers."""
        method, body, headers, kinds = "GET", None, {}, []
        for _ in range(rng.randint(1, 2)):
            op = rng.choice(["query", "suffix", "body", "method", "header"])
            kinds.append(op)
            if op == "query":
                path += rng.choice(["?a=%ff%fe", "?model=%00", "?x=" + "y" * 10_000, "?%ED%A0%80=1", "?a[]=1&a[]=2",
                                    "?limit=-1&after=" + "z" * 300, "?&&&==", "?q=%F0%9F%98%80"])
            elif op == "suffix":
                path += rng.choice(["/", "/%ff", "/..", "/%2e%2e%2f", "/" + self._rand_str(rng, 1, 20), "/x" * 200,
                                    "%00", "//"])
            elif op == "body":
                body = rng.choice([dumps({"model": self.model}), b"\xff\xfe", _nested(DEPTH).encode(), b"NaN"])
                headers = dict(JSON)
            elif op == "method":
                method = rng.choice(["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
            elif op == "header":
                headers[rng.choice(["accept", "authorization", "x-request-id", "content-length-x"])] = \
                    rng.choice(["", "Bearer \u00ff", "a" * 8000, "*/*;q=NaN", "\u00e9t\u00e9"]).encode("latin-1",
                                                                                                  "replace").decode("latin-1")
        return HostileRequest("mutation_get:" + "+".join(kinds), method, path, body, headers, None)

    # ---- the catalog ----
    def catalog(self) -> list[HostileRequest]:
        m, V, ctx = self.model, self.V, self.ctx
        cmp = completion(m, "hi", 4)
        cht = chat(m, "hi", 4)
        out: list[HostileRequest] = []

        def add(kind, body, path="/v1/completions", expect=(400,), method="POST", headers=None, note=""):
            if isinstance(body, (dict, list)):
                body = dumps(body)
            elif isinstance(body, str):
                body = body.encode("utf-8", "surrogatepass")
            out.append(HostileRequest(kind, method, path, body, dict(JSON if headers is None else headers),
                                      None if expect is None else frozenset(expect), note))

        # huge ints (the issue's engine killers first)
        add("huge_int:seed", {"model": m, "prompt": "hi", "max_tokens": 4, "seed": 2**64}, expect=(200, 400))
        add("huge_int:top_k", {**cmp, "top_k": 2**63}, expect=(200, 400))
        add("huge_int:n", {**cmp, "n": 10**9})
        add("huge_int:max_tokens", {**cmp, "max_tokens": 2**63})
        add("huge_int:logprobs", {**cmp, "logprobs": -1})
        add("huge_int:logprobs", {**cmp, "logprobs": 1000})
        add("huge_int:top_logprobs", {**cht, "logprobs": True, "top_logprobs": 1000}, "/v1/chat/completions")
        add("huge_int:prompt_logprobs", {**cmp, "prompt_logprobs": 10**6})
        add("huge_int:min_tokens", {**cmp, "min_tokens": 2**63})
        for f in INT_FIELDS:
            for v in (2**64, -(2**63) - 1):
                add(f"huge_int:{f}", {**cmp, f: v}, expect=(200, 400) if f in ("seed", "top_k") else (400,))
        add("huge_int:seed_chat", {**cht, "seed": 2**64 + 1}, "/v1/chat/completions", expect=(200, 400))
        add("huge_int:stream_seed", {**cmp, "seed": 2**64, "stream": True}, expect=(200, 400))
        add("huge_int:5000_digits", _raw(cmp, "seed", "1" + "0" * 5000))
        add("huge_int:5000_digits_max_tokens", _raw(cmp, "max_tokens", "9" * 5000))
        add("huge_int:detokenize", {"model": m, "tokens": [2**64]}, "/detokenize")
        add("huge_int:detokenize_neg", {"model": m, "tokens": [-1]}, "/detokenize")
        # NaN / Infinity as bare JSON tokens
        for f in FLOAT_FIELDS:
            for tok in NAN_TOKENS:
                add(f"nan:{f}", _raw(cmp, f, tok))
        add("nan:temperature_chat", _raw(cht, "temperature", "NaN"), "/v1/chat/completions")
        add("nan:repetition_penalty_chat", _raw(cht, "repetition_penalty", "NaN"), "/v1/chat/completions")
        add("nan:seed", _raw(cmp, "seed", "NaN"))
        add("nan:max_tokens", _raw(cmp, "max_tokens", "Infinity"))
        add("nan:stream", _raw({**cmp, "stream": True}, "temperature", "Infinity"))
        add("nan:body", "NaN")
        # out-of-range floats
        for f, v in (("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("min_p", -0.5), ("min_p", 2.0),
                     ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("presence_penalty", 1e308),
                     ("frequency_penalty", -1e308)):
            add(f"range:{f}", {**cmp, f: v})
        add("range:temperature_huge", {**cmp, "temperature": 1e308}, expect=(200, 400))
        add("range:temperature_tiny", {**cmp, "temperature": 1e-320}, expect=(200, 400))
        # wrong types
        for f, v in (("max_tokens", "four"), ("max_tokens", 4.5), ("max_tokens", [4]), ("n", {"a": 1}),
                     ("temperature", "hot"), ("temperature", [1]), ("stop", 5), ("stop", {"a": "b"}),
                     ("stop", [1, 2]), ("stream", "maybe"), ("stream_options", 5), ("echo", [1]),
                     ("prompt", 5), ("prompt", None), ("prompt", {"text": "hi"}), ("prompt", [1.5]),
                     ("prompt", [[1], "a"]), ("logit_bias", [1]), ("model", 5),
                     ("model", ["glm"]), ("user", {"a": 1}), ("response_format", "json")):
            add(f"type:{f}", {**cmp, f: v})
        for f, v in (("messages", "hi"), ("messages", {"role": "user"}), ("messages", [5]),
                     ("messages", [None]), ("messages", [[]]), ("logprobs", "yes"), ("tools", "x"),
                     ("chat_template_kwargs", [1]), ("max_completion_tokens", "x"), ("top_logprobs", 1.5)):
            add(f"type:chat_{f}", {**cht, f: v}, "/v1/chat/completions",
                expect=(200, 400) if (f, v) == ("logprobs", "yes") else (400,))
        # what pydantic's lax mode coerces (true -> 1, "yes" -> true): accepting it is no bug
        add("type:prompt_bool", {**cmp, "prompt": [True]}, expect=(200, 400))
        add("type:tokenize_prompt", {"model": m, "prompt": 5}, "/tokenize")
        add("type:tokenize_prompt_null", {"model": m, "prompt": None}, "/tokenize")
        add("type:tokenize_messages", {"model": m, "messages": "hi"}, "/tokenize")
        add("type:detokenize_tokens", {"model": m, "tokens": "abc"}, "/detokenize")
        add("type:detokenize_nested", {"model": m, "tokens": [[1]]}, "/detokenize")
        add("type:detokenize_floats", {"model": m, "tokens": [1.5]}, "/detokenize")
        # deep nesting (10k-deep arrays/objects as the body, in messages, in prompt, on /tokenize)
        for kind in ("list", "dict"):
            for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
                add(f"nesting:body_{kind}", _nested(DEPTH, kind), path, expect=(400, 413))
        add("nesting:messages", _raw({"model": m, "max_tokens": 4}, "messages", _nested(DEPTH)),
            "/v1/chat/completions", expect=(400, 413))
        add("nesting:message_content", _raw({"model": m, "max_tokens": 4}, "messages",
                                            '[{"role": "user", "content": ' + _nested(DEPTH) + "}]"),
            "/v1/chat/completions", expect=(400, 413))
        add("nesting:prompt", _raw({"model": m, "max_tokens": 4}, "prompt", _nested(DEPTH)), expect=(400, 413))
        add("nesting:prompt_obj", _raw({"model": m, "max_tokens": 4}, "prompt", _nested(DEPTH, "dict")),
            expect=(400, 413))
        add("nesting:tokenize_prompt", _raw({"model": m}, "prompt", _nested(DEPTH, "dict")), "/tokenize",
            expect=(400, 413))
        add("nesting:tokenize_messages", _raw({"model": m}, "messages", _nested(DEPTH)), "/tokenize",
            expect=(400, 413))
        add("nesting:stop", _raw(cmp, "stop", _nested(DEPTH)), expect=(400, 413))
        add("nesting:chat_template_kwargs", _raw(cht, "chat_template_kwargs", _nested(DEPTH, "dict")),
            "/v1/chat/completions", expect=(400, 413))
        add("nesting:unknown_field", _raw(cmp, "extra", _nested(DEPTH)), expect=(200, 400, 413))
        add("nesting:100k", _nested(100_000), expect=(400, 413))
        # lone UTF-16 surrogates (valid JSON escapes, not valid Unicode)
        ok_or_400 = (200, 400)
        add("surrogate:prompt", {**cmp, "prompt": "hi \ud800"}, expect=ok_or_400)
        add("surrogate:prompt_list", {**cmp, "prompt": ["ok", "\udfff"]}, expect=ok_or_400)
        add("surrogate:chat_content", chat(m, "\udfff", 4), "/v1/chat/completions", expect=ok_or_400)
        add("surrogate:chat_part", chat(m, [{"type": "text", "text": "a\ud800b"}], 4), "/v1/chat/completions",
            expect=ok_or_400)
        add("surrogate:system", {**cht, "messages": [{"role": "system", "content": "\ud800"}, cht["messages"][0]]},
            "/v1/chat/completions", expect=ok_or_400)
        add("surrogate:stop", {**cmp, "stop": ["\ud800"]}, expect=ok_or_400)
        add("surrogate:stop_chat", {**cht, "stop": "\udfff"}, "/v1/chat/completions", expect=ok_or_400)
        add("surrogate:tokenize", {"model": m, "prompt": "\ud800"}, "/tokenize", expect=ok_or_400)
        add("surrogate:tokenize_chat", {"model": m, "messages": [{"role": "user", "content": "x\udfff"}]},
            "/tokenize", expect=ok_or_400)
        add("surrogate:model", {**cmp, "model": "\ud800"}, expect=(400, 404))
        add("surrogate:user", {**cmp, "user": "\ud800"}, expect=ok_or_400)
        add("surrogate:key", '{"model": "%s", "prompt": "hi", "max_tokens": 4, "\\ud800": 1}' % m, expect=ok_or_400)
        add("surrogate:stream", {**cmp, "prompt": "\ud800\udfff\ud800", "stream": True}, expect=ok_or_400)
        add("surrogate:chat_template_kwargs", {**cht, "chat_template_kwargs": {"x": "\ud800"}},
            "/v1/chat/completions", expect=ok_or_400)
        add("surrogate:tool_name", {**cht, "tools": [{"type": "function", "function": {"name": "\ud800"}}]},
            "/v1/chat/completions", expect=ok_or_400)
        # invalid UTF-8 bytes in the body
        for name, bad in (("ff_fe", b"\xff\xfe"), ("lone_continuation", b"\x80"), ("truncated_seq", b"\xc3"),
                          ("overlong", b"\xc0\xaf"), ("encoded_surrogate", b"\xed\xa0\x80"), ("nul", b"\x00")):
            body = dumps(cmp).replace(b'"hi"', b'"hi' + bad + b'"')
            add(f"utf8:{name}", body, expect=(400,) if name != "nul" else (400,))
            add(f"utf8:{name}_tokenize", b'{"prompt": "' + bad + b'"}', "/tokenize", expect=(400,))
        # UTF-16 with a BOM: RFC 8259 wants UTF-8, Python's json detects UTF-16: either answer is sane
        add("utf8:utf16_body", dumps(cmp).decode().encode("utf-16"), expect=(200, 400))
        add("utf8:bom", b"\xef\xbb\xbf" + dumps(cmp), expect=(200, 400))
        # very large bodies
        big = self.big_body_mb * 2**20
        add("big:prompt_20mb", b'{"model": "%s", "max_tokens": 4, "prompt": "' % m.encode() + b"a" * big + b'"}',
            expect=(413,))
        add("big:garbage_20mb", b"x" * big, "/tokenize", expect=(413,))
        add("big:array_20mb", b'{"model": "%s", "tokens": [' % m.encode() + b"1," * (big // 2) + b'1]}',
            "/detokenize", expect=(413,))
        add("big:prompt_over_context", completion(m, [11] * (ctx + 10), 4))
        add("big:text_over_context", completion(m, "word " * (ctx * 4), 4))
        add("big:max_tokens_over_context", completion(m, "hi", ctx))
        add("big:many_prompts", completion(m, [[11, 12]] * 4000, 1), expect=None,
            note="4000 prompts in one request: a legal fan-out; 200, or a clean 4xx/503")
        add("big:n_max", completion(m, "hi", 1, n=129))
        add("big:stop_ids_many", {**cmp, "stop_token_ids": list(range(100_000))}, expect=(200, 400))
        add("big:stop_strings_many", {**cmp, "stop": ["x"] * 10_000}, expect=(200, 400))
        add("big:messages_many", {"model": m, "max_tokens": 4, "messages": [{"role": "user", "content": "a"}] * 20_000},
            "/v1/chat/completions")
        add("big:header_64k", cmp, headers={**JSON, "x-filler": "a" * 65536}, expect=(200, 400, 413, 431))
        # roles and content
        for role in ("wizard", "", "USER", "function_call"):
            add(f"chat:role_{role or 'empty'}", {**cht, "messages": [{"role": role, "content": "hi"}]},
                "/v1/chat/completions")
        add("chat:role_number", {**cht, "messages": [{"role": 5, "content": "hi"}]}, "/v1/chat/completions")
        add("chat:role_missing", {**cht, "messages": [{"content": "hi"}]}, "/v1/chat/completions")
        add("chat:content_null", {**cht, "messages": [{"role": "user", "content": None}]}, "/v1/chat/completions")
        add("chat:content_missing", {**cht, "messages": [{"role": "user"}]}, "/v1/chat/completions")
        add("chat:content_dict", {**cht, "messages": [{"role": "user", "content": {"text": "hi"}}]},
            "/v1/chat/completions")
        add("chat:content_number", {**cht, "messages": [{"role": "user", "content": 5}]}, "/v1/chat/completions")
        for part in ({"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "bogus"}, {"text": "hi"},
                     {"type": 5, "text": "hi"}, {"type": "text", "text": 5}, {"type": "text"}, "hi", None):
            add("chat:content_part", {**cht, "messages": [{"role": "user", "content": [part]}]},
                "/v1/chat/completions")
        add("chat:messages_empty", {**cht, "messages": []}, "/v1/chat/completions")
        add("chat:messages_missing", {"model": m, "max_tokens": 4}, "/v1/chat/completions")
        add("chat:tokenize_role", {"model": m, "messages": [{"role": "wizard", "content": "hi"}]}, "/tokenize")
        add("chat:tokenize_content_null", {"model": m, "messages": [{"role": "user", "content": None}]}, "/tokenize")
        add("chat:both_generation_flags", {**cht, "add_generation_prompt": True, "continue_final_message": True},
            "/v1/chat/completions")
        add("chat:template_kwargs_reserved", {**cht, "chat_template_kwargs": {"tokenize": True, "messages": 5}},
            "/v1/chat/completions", expect=(200, 400))
        add("chat:top_logprobs_without_logprobs", {**cht, "top_logprobs": 2}, "/v1/chat/completions")
        # stop_token_ids out of range (with min_tokens: the masking path)
        add("stop_ids:negative", {**cmp, "stop_token_ids": [-5]})
        add("stop_ids:negative_min_tokens", {**cmp, "stop_token_ids": [-5], "min_tokens": 2})
        add("stop_ids:vocab_min_tokens", {**cmp, "stop_token_ids": [V], "min_tokens": 2})
        add("stop_ids:huge_min_tokens", {**cmp, "stop_token_ids": [10**9], "min_tokens": 4})
        add("stop_ids:int64_min_tokens", {**cmp, "stop_token_ids": [2**63], "min_tokens": 1})
        add("stop_ids:chat_vocab_min_tokens", {**cht, "stop_token_ids": [V + 7], "min_tokens": 3},
            "/v1/chat/completions")
        add("stop_ids:stream_vocab_min_tokens", {**cmp, "stop_token_ids": [V], "min_tokens": 2, "stream": True})
        add("stop_ids:string", {**cmp, "stop_token_ids": ["1"]}, expect=(200, 400))
        add("min_tokens:over_max", {**cmp, "min_tokens": 5})
        add("min_tokens:negative", {**cmp, "min_tokens": -1})
        # token-id prompts out of vocab
        for ids in ([V], [-1], [2**63], [10**40], [11, V + 100, 12]):
            add("token_ids:out_of_vocab", completion(m, ids, 4))
        add("token_ids:batch_out_of_vocab", completion(m, [[11, 12], [V]], 4))
        add("token_ids:stream_out_of_vocab", completion(m, [V * 2], 4, stream=True))
        # empty prompts
        for p in ("", [], [[]], [""], ["a", ""]):
            add("prompt:empty", completion(m, p, 4))
        add("prompt:tokenize_empty", {"model": m, "prompt": ""}, "/tokenize", expect=(200, 400))
        add("prompt:chat_empty_content", chat(m, "", 2), "/v1/chat/completions", expect=(200, 400))
        # models
        add("model:unknown", {**cmp, "model": "gpt-4"}, expect=(404,))
        add("model:unknown_chat", {**cht, "model": "no-such-model"}, "/v1/chat/completions", expect=(404,))
        add("model:unknown_tokenize", {"model": "nope", "prompt": "hi"}, "/tokenize", expect=(404,))
        add("model:unknown_detokenize", {"model": "nope", "tokens": [1]}, "/detokenize", expect=(404,))
        add("model:unknown_stream", {**cmp, "model": "nope", "stream": True}, expect=(404,))
        add("model:get_unknown", None, "/v1/models/no-such-model", method="GET", expect=(404,))
        add("model:get_traversal", None, "/v1/models/..%2F..%2Fetc%2Fpasswd", method="GET", expect=(404,))
        add("model:get_nul", None, "/v1/models/%00", method="GET", expect=(400, 404))
        add("model:get_surrogate", None, "/v1/models/%ED%A0%80", method="GET", expect=(400, 404))
        add("model:get_long", None, "/v1/models/" + "m" * 20_000, method="GET", expect=(404, 414, 400))
        # methods and paths
        for method, path in (("GET", "/v1/completions"), ("PUT", "/v1/chat/completions"), ("DELETE", "/v1/models"),
                             ("POST", "/v1/models"), ("POST", "/health"), ("PATCH", "/tokenize"),
                             ("GET", "/detokenize"), ("DELETE", "/v1/completions")):
            add(f"method:{method}_{path}", None if method == "GET" else cmp, path, method=method, expect=(405,))
        for path in ("/v1/nope", "/v1/completions/extra", "/v2/completions", "/v1", "/%2e%2e/%2e%2e/etc/passwd",
                     "/v1/chat", "/" + "x" * 10_000):
            add(f"path:{path[:20]}", cmp, path, expect=(404, 405, 414, 400))
        add("method:OPTIONS", None, "/v1/completions", method="OPTIONS", expect=(200, 204, 400, 405))
        add("method:HEAD_health", None, "/health", method="HEAD", expect=(200, 405))
        # content types
        add("ctype:text_plain", cmp, headers={"content-type": "text/plain"}, expect=(200, 400, 415))
        add("ctype:none", cmp, headers={}, expect=(200, 400, 415))
        add("ctype:form", b"model=x&prompt=hi", headers={"content-type": "application/x-www-form-urlencoded"},
            expect=(400, 415))
        add("ctype:multipart", b"--b\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nhi\r\n--b--\r\n",
            headers={"content-type": "multipart/form-data; boundary=b"}, expect=(400, 415))
        add("ctype:utf16_charset", cmp, headers={"content-type": "application/json; charset=utf-16"},
            expect=(200, 400, 415))
        add("ctype:garbage", cmp, headers={"content-type": "foo/bar;;;=;"}, expect=(200, 400, 415))
        add("protocol:control_chars_in_header", cmp, headers={"content-type": "\x01\x02;;;="}, expect=None)
        out[-1].app_level = False
        # JSON syntax
        text = dumps(cmp)
        for cut in (1, len(text) // 2, len(text) - 1):
            add("json:truncated", text[:cut])
        add("json:truncated_chat", dumps(cht)[:-3], "/v1/chat/completions")
        add("json:truncated_tokenize", b'{"prompt": "hi', "/tokenize")
        for body in (b"", b"null", b"[]", b'"str"', b"1e999", b"-", b"{", b"}", b"{,}", b"{'a': 1}", b"true",
                     b'{"a" 1}', b'{"model": "x",}', b"\x00\x00"):
            add("json:not_an_object", body)
        add("json:duplicate_keys", b'{"model": "%s", "prompt": "hi", "max_tokens": 4, "max_tokens": %d}'
            % (m.encode(), 2**64))
        add("json:duplicate_keys_ok", b'{"model": "%s", "prompt": "hi", "max_tokens": 2**70, "max_tokens": 2}'
            % m.encode(), expect=(400,))
        add("json:duplicate_messages", b'{"model": "%s", "max_tokens": 2, "messages": 5, "messages": '
            b'[{"role": "user", "content": "hi"}]}' % m.encode(), "/v1/chat/completions", expect=(200, 400))
        add("json:trailing_garbage", text + b"garbage")
        add("json:two_objects", text + text)
        # unsupported features
        add("unsupported:logit_bias", {**cmp, "logit_bias": {"11": 100}})
        add("unsupported:response_format", {**cht, "response_format": {"type": "json_schema"}}, "/v1/chat/completions")
        add("unsupported:suffix", {**cmp, "suffix": "x"})
        add("unsupported:best_of", {**cmp, "best_of": 3})
        return out

    # ---- random mutations of valid bodies ----
    def mutated(self, rng: random.Random) -> HostileRequest:
        method, path, body = self.valid(rng)
        if body is None:
            return self.mutated_get(rng, path)
        body = copy.deepcopy(body)
        ops = rng.randint(1, 3)
        raw: Optional[bytes] = None
        headers = dict(JSON)
        kinds = []
        for _ in range(ops):
            op = rng.choices(["set", "delete", "extra", "raw_value", "nest", "whole", "bytes", "truncate",
                              "ctype", "method", "message"],
                             weights=[30, 8, 6, 10, 4, 3, 5, 5, 3, 2, 8])[0]
            kinds.append(op)
            if op == "set":
                key = rng.choice(sorted(body) + INT_FIELDS + FLOAT_FIELDS + ["stop", "stop_token_ids", "stream"])
                body[key] = self._hostile_value(rng, key)
            elif op == "delete" and body:
                key = rng.choice(sorted(body))
                if key not in PROTECTED:
                    body.pop(key)
            elif op == "extra":
                body[self._rand_str(rng, 1, 12)] = self._hostile_value(rng, "")
            elif op == "raw_value":
                key = rng.choice(sorted(body) + FLOAT_FIELDS + INT_FIELDS)
                raw = _raw(body, key, rng.choice(NAN_TOKENS + ["1" + "0" * rng.choice([20, 400, 5000]), "1e999",
                                                              "-0", "1E400", "0.0e-999"]))
            elif op == "nest":
                key = rng.choice(sorted(body) or ["x"])
                raw = _raw(body, key, _nested(rng.choice([100, 1000, DEPTH]), rng.choice(["list", "dict"])))
            elif op == "whole":
                raw = rng.choice([b"[]", b"null", b"0", b'"x"', dumps([body]), _nested(DEPTH).encode()])
            elif op == "bytes":
                data = bytearray(raw if raw is not None else dumps(body))
                for _ in range(rng.randint(1, 4)):
                    pos = rng.randrange(len(data) + 1)
                    data[pos:pos] = rng.choice([b"\xff", b"\x80", b"\xed\xa0\x80", b"\x00", b"\\", b'"', b"\\ud800",
                                                b"}", b"[", bytes([rng.randrange(256)])])
                raw = bytes(data)
            elif op == "truncate":
                data = raw if raw is not None else dumps(body)
                raw = data[:rng.randrange(max(1, len(data)))]
            elif op == "ctype":
                headers = rng.choice([{}, {"content-type": "text/plain"}, {"content-type": "application/xml"},
                                      {"content-type": "application/json; charset=latin-1"}])
            elif op == "method":
                method = rng.choice(["GET", "PUT", "DELETE", "PATCH"])
            elif op == "message" and isinstance(body.get("messages"), list) and body["messages"] \
                    and isinstance(body["messages"][0], dict):
                msg = body["messages"][0] = dict(body["messages"][0])
                key = rng.choice(["role", "content", "name", "tool_calls", "tool_call_id"])
                msg[key] = rng.choice([None, "wizard", "", "\ud800", 5, [], [{"type": "bogus"}], {"a": 1},
                                       [{"type": "text", "text": None}], self._rand_str(rng, 0, 40)])
        data = raw if raw is not None else dumps(body)
        return HostileRequest("mutation:" + "+".join(kinds), method, path, data if method != "GET" else None,
                              headers, None)

    def _rand_str(self, rng: random.Random, lo: int, hi: int) -> str:
        # No '.', ':' or digits-with-dots: an echoed value must not look like a leaked path or IP.
        alphabet = "abcdefghijklmnopqrstuvwxyzABCXYZ_- éß中\u0301\U0001F600"
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))

    def _hostile_value(self, rng: random.Random, key: str) -> Any:
        pool = [None, True, False, 0, -1, -5, 1, 3, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30,
                0.5, -0.0, 1e-320, 1e308, -1e308, float("nan"), float("inf"), float("-inf"),
                "", "1", "\ud800", "\udfff", self._rand_str(rng, 1, 30), "x" * rng.choice([100, 10_000]),
                [], [1, 2], [-5], [self.V], ["a", "b"], [[1]], [None], {}, {"a": 1}, {"type": "text"}]
        v = rng.choice(pool)
        if key in PROTECTED and isinstance(v, int) and not isinstance(v, bool) and 4 < v < 2**31:
            v = 4                               # never a valid *long* generation
        if key == "n" and isinstance(v, int) and not isinstance(v, bool) and 4 < v <= 128:
            v = 4
        return v

    def requests(self, n: int) -> list[HostileRequest]:
        """The first `n` of: the catalog (in a seeded order), then seeded random mutations (10% of
        them valid requests, which must succeed: the server keeps serving while it is fuzzed)."""
        rng = random.Random(self.seed)
        cat = self.catalog()
        rng.shuffle(cat)
        out = cat[:n]
        while len(out) < n:
            if rng.random() < 0.1:
                method, path, body = self.valid(rng)
                out.append(HostileRequest("valid", method, path, None if body is None else dumps(body),
                                          dict(JSON) if body is not None else {}, frozenset({200})))
            else:
                out.append(self.mutated(rng))
        return out


# ------------------------------------------------------------------------------------------------
# Fuzz runner
# ------------------------------------------------------------------------------------------------


def _server_failed(reply: Reply) -> bool:
    """No answer, a 5xx, or a 503 that is not "busy, retry" (see OVERLOAD_CODES)."""
    if reply.status is None:
        return True
    if reply.status == 503:
        return not (_retry_after_ok(reply.headers) and _error_code(reply) in OVERLOAD_CODES)
    return reply.status >= 500


def run_requests(base_url: str, model: str, reqs: list[HostileRequest], concurrency: int = 4, timeout: float = 60.0,
                 deadline_s: float = 3600.0, recover_timeout: float = 180.0) -> list[tuple[HostileRequest, Reply, list[str]]]:
    """Send `reqs` (bounded concurrency, overall deadline); returns (request, reply, problems).

    After a server failure (5xx other than 503 + Retry-After, or no response) sending pauses until
    the app serves again (bounded by `recover_timeout`), and that request's problems say how long the
    app was down: a request that kills the engine is named as the cause, and the requests after it
    are not drowned in the 503s of a dead engine."""
    t_end = time.monotonic() + deadline_s
    results: list = [None] * len(reqs)
    gate = threading.Event()
    gate.set()
    recovering = threading.Lock()

    def one(i: int):
        if not gate.wait(recover_timeout + 30) or time.monotonic() > t_end:
            return
        reply = send(base_url, reqs[i], timeout)
        problems = check_reply(reqs[i], reply)
        if _server_failed(reply) and recovering.acquire(blocking=False):
            gate.clear()
            try:
                ok, _ = is_healthy(base_url, model)
                if not ok:
                    try:
                        problems.append(f"the app stopped serving after this request; "
                                        f"serving again after {wait_healthy(base_url, model, recover_timeout):.0f}s")
                    except TimeoutError as e:
                        problems.append(f"the app stopped serving after this request: {e}")
                        results[i] = (reqs[i], reply, problems)
                        raise
            finally:
                gate.set()
                recovering.release()
        results[i] = (reqs[i], reply, problems)

    with cf.ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(one, i) for i in range(len(reqs))]
        for f in futures:
            try:
                f.result()
            except TimeoutError:
                t_end = 0              # the app is gone: stop sending (the remaining ones return at once)
    return [r for r in results if r is not None]


def summarize_fuzz(results, alive: tuple[bool, str], max_examples: int = 40) -> dict:
    statuses: dict[str, int] = {}
    failures = []
    n5xx = leak_count = transport = wrong = shape = 0
    for req, reply, problems in results:
        statuses[str(reply.status)] = statuses.get(str(reply.status), 0) + 1
        if reply.status is None:
            transport += 1
        elif _server_failed(reply):
            n5xx += 1
        if any(p.startswith("leaked") for p in problems):
            leak_count += 1
        if any(p.startswith("status ") for p in problems):
            wrong += 1
        if any(p.startswith(("error body", "error.", "error content", "no x-request-id", "422", "500 whose",
                             "event stream", "unparsable", "error event")) for p in problems):
            shape += 1
        if problems:
            failures.append({"request": req.describe(), "status": reply.status, "problems": problems,
                             "response": (reply.text[:300] if reply.status is not None else reply.transport_error)})
    return {"requests": len(results), "statuses": statuses, "server_errors": n5xx, "leaks": leak_count,
            "transport_errors": transport, "wrong_status": wrong, "bad_shape": shape,
            "failed_requests": len(failures), "alive_after": alive[0], "alive_detail": alive[1],
            "failures": failures[:max_examples]}


def run_fuzz(base_url: str, model: str, vocab_size: int, max_model_len: int, n: int, seed: int = 0,
             concurrency: int = 4, timeout: float = 60.0, deadline_s: float = 3600.0) -> dict:
    reqs = HostileGenerator(seed, model, vocab_size, max_model_len).requests(n)
    t0 = time.monotonic()
    results = run_requests(base_url, model, reqs, concurrency, timeout, deadline_s)
    out = summarize_fuzz(results, is_healthy(base_url, model))
    out.update(seed=seed, planned=n, seconds=round(time.monotonic() - t0, 1))
    return out


# ------------------------------------------------------------------------------------------------
# Ray driver: the Router's stats, actors and their processes
# ------------------------------------------------------------------------------------------------


class RayDriver:
    """`with RayDriver(cluster.gcs_address, cluster.dashboard_url) as rd: rd.stats("faults")`.

    The state API is always given this cluster's dashboard address: without one it picks the latest
    Ray instance on the machine, which may be somebody else's."""

    def __init__(self, gcs_address: str, dashboard_url: str):
        self.gcs_address, self.dashboard_url = gcs_address, dashboard_url
        self._handles: dict = {}

    def __enter__(self) -> "RayDriver":
        import logging

        import ray
        ray.init(address=self.gcs_address, log_to_driver=False, logging_level=logging.WARNING)
        return self

    def __exit__(self, *exc) -> None:
        import ray
        self._handles.clear()
        ray.shutdown()

    def stats(self, app: str, timeout: float = 10.0) -> dict:
        from ray import serve
        h = self._handles.get(app)
        if h is None:
            h = self._handles[app] = serve.get_deployment_handle("Router", app_name=app)
        return h.stats.remote().result(timeout_s=timeout)

    def kv_capacity(self, app: str) -> int:
        """The app's KV capacity in tokens, as its Router reports it (stats()["kv_capacity_tokens"])."""
        s = self.stats(app)
        if not s.get("kv_capacity_tokens"):
            raise AssertionError(f"the Router of {app!r} reports no kv_capacity_tokens in stats(): {sorted(s)}")
        return int(s["kv_capacity_tokens"])

    def wait_idle(self, app: str, timeout: float) -> tuple[Optional[float], dict]:
        """Seconds until running == waiting == 0 and kv_usage == 0 (None if not within timeout)."""
        t0 = time.monotonic()
        s: dict = {}
        while True:
            try:
                s = self.stats(app)
                if s["running"] == 0 and s["waiting"] == 0 and s["kv_usage"] == 0:
                    return time.monotonic() - t0, s
            except Exception as e:  # noqa: BLE001  (a dead replica: keep polling until timeout)
                s = {"error": repr(e)[:200]}
            if time.monotonic() - t0 > timeout:
                return None, s
            time.sleep(0.05)

    def worker_actor_names(self, app: str) -> list[tuple[str, str]]:
        import ray
        return [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(f"glm-ray-worker:{app}:")]

    def kill_workers(self, app: str) -> int:
        import ray
        names = self.worker_actor_names(app)
        for name, ns in names:
            ray.kill(ray.get_actor(name, namespace=ns))
        return len(names)

    def serving_processes(self, apps: Iterable[str]) -> dict[str, int]:
        """{label: pid} of the processes that serve `apps`: each app's Router, ingress and TP
        workers, and the HTTP proxy."""
        from ray.util.state import list_actors
        apps = list(apps)
        out = {}
        for a in list_actors(address=self.dashboard_url, filters=[("state", "=", "ALIVE")], detail=True,
                             limit=10_000):
            cls, name, pid = a.class_name or "", a.name or "", a.pid
            if cls == "ProxyActor":
                out["proxy"] = pid
            for app in apps:
                if cls == f"ServeReplica:{app}:Router":
                    out[f"{app}/router"] = pid
                elif cls == f"ServeReplica:{app}:OpenAIIngress":
                    out[f"{app}/ingress"] = pid
                elif cls == "WorkerActor" and name.startswith(f"glm-ray-worker:{app}:"):
                    out[f"{app}/worker{name.rsplit(':rank', 1)[-1]}"] = pid
        return out


class StatsSampler:
    """Polls one app's Router stats in the background: peaks of running/waiting/kv_usage."""

    def __init__(self, rd: RayDriver, app: str, every: float = 0.1):
        self.rd, self.app, self.every = rd, app, every
        self.peak = {"running": 0, "waiting": 0, "kv_usage": 0.0}
        self.preemptions = (None, None)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        first = None
        while not self._stop.is_set():
            try:
                s = self.rd.stats(self.app)
                for k in self.peak:
                    self.peak[k] = max(self.peak[k], s[k])
                p = s.get("num_preemptions")
                first = p if first is None else first
                self.preemptions = (first, p)
            except Exception:  # noqa: BLE001
                pass
            self._stop.wait(self.every)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(5)


# ------------------------------------------------------------------------------------------------
# Normal traffic helpers
# ------------------------------------------------------------------------------------------------


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 890) for _ in range(n)]     # below the fault tokens (900..902)


def classify_generation(reply: Reply, max_tokens: Optional[int] = None) -> tuple[str, str]:
    """("completed" | "rejected" | "lost", detail) for a generation request.

    completed: 200 with every choice finished ("length"/"stop"), a stream ending in [DONE] with no
    error event; rejected: 429, or 503 + Retry-After with a "busy" code (OVERLOAD_CODES), in OpenAI's
    shape; lost: anything else (a 503 of an engine that is down included)."""
    if reply.status is None:
        return "lost", f"no response: {reply.transport_error}"
    problems = check_reply(None, reply)
    if reply.status in (429, 503):
        if problems:
            return "lost", f"{reply.status} not clean: {problems}"
        return "rejected", f"{reply.status}"
    if reply.status != 200 or problems:
        return "lost", f"{reply.status}: {problems} {reply.text[:200]!r}"
    if reply.headers.get("content-type", "").startswith("text/event-stream"):
        events, _ = sse_events(reply.body)
        finishes = [c.get("finish_reason") for e in events for c in (e.get("choices") or []) if c.get("finish_reason")]
        if not finishes:
            return "lost", "stream ended without a finish_reason"
        return "completed", ",".join(finishes)
    try:
        obj = reply.json()
        fins = [c["finish_reason"] for c in obj["choices"]]
        toks = obj["usage"]["completion_tokens"]
    except (ValueError, KeyError, TypeError) as e:
        return "lost", f"malformed 200 body: {e!r} {reply.text[:200]!r}"
    if any(f not in ("length", "stop") for f in fins):
        return "lost", f"finish_reason {fins}"
    if max_tokens is not None and fins == ["length"] and toks != max_tokens:
        return "lost", f"finish 'length' after {toks} of {max_tokens} tokens"
    return "completed", ",".join(fins)


# ------------------------------------------------------------------------------------------------
# Scenario: 4x KV overload
# ------------------------------------------------------------------------------------------------


def run_overload(base_url: str, model: str, rd: RayDriver, app: str, max_model_len: int, factor: float = 4.0,
                 prompt_len: int = 64, max_tokens: int = 192, seed: int = 0, timeout: float = 600.0) -> dict:
    """ceil(factor x KV capacity / (prompt + max_tokens)) requests at once (half streaming, half
    chat/completions); each must complete or get a clean 429/503. Then the KV must be empty again."""
    capacity = rd.kv_capacity(app)
    per = prompt_len + max_tokens
    assert per <= max_model_len, (per, max_model_len)
    n = math.ceil(factor * capacity / per)
    rng = random.Random(seed)
    bodies = []
    for i in range(n):
        ids = _ids(rng, prompt_len)
        common = dict(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=FAULT_TOKENS, stream=bool(i % 2),
                      temperature=1.0, seed=i)
        if i % 4 == 3:      # a chat request: its prompt is a text of about prompt_len tokens
            body = {"model": model, "messages": [{"role": "user", "content": " ".join(["word"] * (prompt_len - 16))}],
                    **common}
            bodies.append(("/v1/chat/completions", body))
        else:
            bodies.append(("/v1/completions", completion(model, ids, **common)))
    t0 = time.monotonic()
    with StatsSampler(rd, app) as sampler, cf.ThreadPoolExecutor(min(n, 128)) as pool:
        replies = list(pool.map(lambda b: post_json(base_url, b[0], b[1], timeout), bodies))
    elapsed = time.monotonic() - t0
    outcomes = {"completed": 0, "rejected": 0, "lost": 0}
    lost = []
    for (path, body), reply in zip(bodies, replies):
        what, detail = classify_generation(reply, max_tokens)
        outcomes[what] += 1
        if what == "lost":
            lost.append(f"{path} stream={body['stream']}: {detail}")
    idle_s, last = rd.wait_idle(app, timeout=10)
    p0, p1 = sampler.preemptions
    return {"kv_capacity_tokens": capacity, "requests": n,
            "tokens_requested": n * per, "factor": round(n * per / capacity, 2), **outcomes,
            "lost_examples": lost[:10], "peak": sampler.peak,
            "preemptions": (p1 - p0) if (p0 is not None and p1 is not None) else None,
            "seconds": round(elapsed, 1), "idle_after_s": idle_s, "stats_after": _brief(last),
            "alive_after": is_healthy(base_url, model)[0]}


def _brief(s: dict) -> dict:
    return {k: s[k] for k in ("running", "waiting", "kv_usage", "error") if k in s}


# ------------------------------------------------------------------------------------------------
# Scenario: disconnect storm
# ------------------------------------------------------------------------------------------------


def _stream_then_disconnect(base_url: str, path: str, body: dict, chunks: int, budget_s: float) -> dict:
    """Open an SSE stream with a raw connection, read `chunks` data events, then drop the socket."""
    u = urlsplit(base_url.rstrip("/") + path)
    _assert_loopback(base_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=budget_s)
    t0 = time.monotonic()
    seen, status, events = 0, None, []
    try:
        conn.request("POST", u.path, body=dumps(body), headers=JSON)
        resp = conn.getresponse()
        status = resp.status
        if status == 200:
            while seen < chunks and time.monotonic() - t0 < budget_s:
                line = resp.fp.readline()
                if not line:
                    break
                if line.startswith(b"data:"):
                    events.append(line[:300].decode("utf-8", "replace").strip())
                    seen += b"[DONE]" not in line and b'"error"' not in line
        else:
            events.append(resp.read(300).decode("utf-8", "replace"))
    except (OSError, http.client.HTTPException) as e:
        return {"status": status, "chunks": seen, "error": repr(e)[:200], "closed_at": time.monotonic(),
                "events": events[-3:], "seconds": round(time.monotonic() - t0, 1)}
    finally:
        try:
            import socket
            if conn.sock is not None:
                conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        conn.close()
    out = {"status": status, "chunks": seen, "closed_at": time.monotonic(), "seconds": round(time.monotonic() - t0, 1)}
    if seen < chunks:
        out["events"] = events[-3:]          # why it ended early
    return out


def run_disconnect_storm(base_url: str, model: str, rd: RayDriver, app: str, n: int = 20, chunks: int = 3,
                         max_tokens: int = 1000, seed: int = 0, budget_s: float = 300.0) -> dict:
    """n streams (completions and chat) that each disconnect after `chunks` events; afterwards the
    Router must be back to running = waiting = 0 and kv_usage = 0 within 2 s of the last disconnect."""
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        common = dict(max_tokens=max_tokens, ignore_eos=True, stream=True, stop_token_ids=FAULT_TOKENS)
        if i % 2:
            jobs.append(("/v1/chat/completions", chat(model, "tell me a long story", **common)))
        else:
            jobs.append(("/v1/completions", completion(model, _ids(rng, 16), **common)))
    before, _ = rd.wait_idle(app, timeout=30)
    with StatsSampler(rd, app) as sampler, cf.ThreadPoolExecutor(n) as pool:
        outs = list(pool.map(lambda j: _stream_then_disconnect(base_url, j[0], j[1], chunks, budget_s), jobs))
    last_close = max(o["closed_at"] for o in outs)
    t_poll = time.monotonic()
    idle_s, last = rd.wait_idle(app, timeout=30)
    drain = None if idle_s is None else t_poll + idle_s - last_close     # from the last disconnect
    mid_stream = sum(1 for o in outs if o["status"] == 200 and o["chunks"] >= chunks)
    return {"streams": n, "mid_stream_disconnects": mid_stream,
            "other": [o for o in outs if not (o["status"] == 200 and o["chunks"] >= chunks)][:5],
            "peak": sampler.peak, "idle_before": before is not None,
            "drain_s": None if drain is None else round(drain, 3), "stats_after": _brief(last),
            "alive_after": is_healthy(base_url, model)[0]}


# ------------------------------------------------------------------------------------------------
# Scenario: an injected fault inside a step
# ------------------------------------------------------------------------------------------------

FAULT_EXPECT = {  # kind -> (token, HTTP status of the poisoned request, error code)
    "exception": (EXCEPTION_TOKEN, 500, "engine_error"),
    "oom": (OOM_TOKEN, 503, "out_of_memory"),
    "sample": (SAMPLE_TOKEN, 500, None),
}


class HealthWatcher:
    """GETs /health every `every` s in the background; records every non-200."""

    def __init__(self, base_url: str, every: float = 0.2):
        self.base_url, self.every = base_url, every
        self.bad: list[str] = []
        self.count = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            r = send(self.base_url, HostileRequest("health", "GET", "/health"), 10)
            self.count += 1
            if r.status != 200:
                self.bad.append(f"{r.status} {r.text[:120] or r.transport_error}")
            self._stop.wait(self.every)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(15)


def _error_of(reply: Reply) -> dict:
    try:
        err = reply.json()["error"]
        return err if isinstance(err, dict) else {}
    except (ValueError, KeyError, TypeError):
        return {}


def _sse_error(reply: Reply) -> Optional[dict]:
    events, _ = sse_events(reply.body)
    for e in events:
        if isinstance(e, dict) and isinstance(e.get("error"), dict):
            return e["error"]
    return None


def run_injected_fault(base_url: str, model: str, rd: RayDriver, app: str, kind: str, bystanders: int = 3,
                       later: int = 3, seed: int = 0, timeout: float = 120.0) -> dict:
    """Bystander streams are running (decoding) when a poisoned request arrives.

    exception/oom: the step that computes the poisoned prompt fails; the poisoned request gets
    500 "engine_error" / 503 + Retry-After "out_of_memory"; the bystanders in that same step either
    finish or end with an SSE error event of the same code and [DONE]; nothing hangs.
    sample: only the poisoned request fails (500); its batch-mates finish normally.
    Always: /health stays 200 throughout, requests after the fault succeed, the KV is freed."""
    token, want_status, want_code = FAULT_EXPECT[kind]
    rng = random.Random(seed)
    problems: list[str] = []
    started = threading.Barrier(bystanders + 1, timeout=timeout)
    results: dict[int, Reply] = {}

    def bystander(i: int):
        body = completion(model, _ids(rng, 8), 200, ignore_eos=True, stop_token_ids=FAULT_TOKENS, stream=True,
                          seed=100 + i)
        u = base_url.rstrip("/") + "/v1/completions"
        _assert_loopback(u)
        t0 = time.monotonic()
        chunks, got_first = [], False
        try:
            with _session().post(u, data=dumps(body), headers=JSON, stream=True, timeout=(5, timeout)) as r:
                headers = {k.lower(): v for k, v in r.headers.items()}
                for line in r.iter_lines():
                    chunks.append(line)
                    if not got_first and line.startswith(b"data:"):
                        got_first = True
                        _barrier_wait(started)
                results[i] = Reply(r.status_code, headers, b"\n".join(chunks), time.monotonic() - t0)
        except requests.RequestException as e:
            _local.session = None
            results[i] = Reply(None, {}, b"\n".join(chunks), time.monotonic() - t0, repr(e)[:200])
        if not got_first:
            _barrier_wait(started)

    with HealthWatcher(base_url) as hw:
        threads = [threading.Thread(target=bystander, args=(i,)) for i in range(bystanders)]
        for t in threads:
            t.start()
        _barrier_wait(started)                         # every bystander is decoding
        poison_ids = [11, 12, token, 13]
        poisoned = post_json(base_url, "/v1/completions",
                             completion(model, poison_ids, 8, stop_token_ids=FAULT_TOKENS), timeout)
        poisoned_stream = post_json(base_url, "/v1/completions",
                                    completion(model, [14, token, 15], 8, stream=True, stop_token_ids=FAULT_TOKENS),
                                    timeout)
        for t in threads:
            t.join(timeout)
        after = [post_json(base_url, "/v1/completions",
                           completion(model, _ids(rng, 6), 8, stop_token_ids=FAULT_TOKENS), timeout)
                 for _ in range(later)]
    # the poisoned requests
    for label, reply in (("poisoned", poisoned), ("poisoned stream", poisoned_stream)):
        if reply.status is None:
            problems.append(f"{label}: no response ({reply.transport_error})")
            continue
        leak = leaks(reply.text)
        if leak:
            problems.append(f"{label}: leaked internals {leak}: {reply.text[:200]!r}")
        err = _error_of(reply) if reply.status != 200 else (_sse_error(reply) or {})
        status = reply.status
        if status == 200 and err:
            status = want_status                   # failed after the stream began: the SSE error event
            if not sse_events(reply.body)[1]:
                problems.append(f"{label}: SSE error event not followed by [DONE]")
        if status != want_status:
            problems.append(f"{label}: status {reply.status} (want {want_status}): {reply.text[:200]!r}")
        if want_code and err.get("code") != want_code:
            problems.append(f"{label}: error code {err.get('code')!r} (want {want_code!r}): {reply.text[:200]!r}")
        if reply.status == 503 and not _retry_after_ok(reply.headers):
            problems.append(f"{label}: 503 without Retry-After")
        if reply.status == 500:
            rid = reply.headers.get("x-request-id")
            if not rid or rid not in reply.text:
                problems.append(f"{label}: 500 that does not name its x-request-id ({rid})")
        if reply.status != 200:
            problems += [f"{label}: {p}" for p in check_error_body(reply)]
    # the bystanders
    ok = failed_clean = 0
    for i in range(bystanders):
        r = results.get(i)
        if r is None or r.status is None:
            problems.append(f"bystander {i}: no response ({None if r is None else r.transport_error})")
            continue
        events, done = sse_events(r.body)
        err = _sse_error(r)
        if r.status == 200 and err is None and done:
            ok += 1
        elif kind != "sample" and r.status == 200 and err is not None and done and err.get("code") == want_code \
                and not leaks(json.dumps(err)):
            failed_clean += 1
        else:
            problems.append(f"bystander {i}: status {r.status}, [DONE]={done}, error={err}: {r.text[-200:]!r}")
    later_ok = sum(1 for r in after if r.status == 200)
    if later_ok != later:
        problems.append(f"requests after the fault: {later_ok}/{later} OK: "
                        f"{[(r.status, r.text[:120]) for r in after if r.status != 200]}")
    if hw.bad:
        problems.append(f"/health not 200 during the fault: {hw.bad[:3]}")
    idle_s, last = rd.wait_idle(app, timeout=5)
    if idle_s is None:
        problems.append(f"KV/running not back to 0 after the fault: {_brief(last)}")
    return {"kind": kind, "poisoned_status": poisoned.status, "poisoned_code": _error_of(poisoned).get("code"),
            "poisoned_stream_status": poisoned_stream.status, "bystanders": bystanders,
            "bystanders_ok": ok, "bystanders_failed_clean": failed_clean, "later_ok": later_ok, "later": later,
            "health_checks": hw.count, "health_bad": len(hw.bad), "idle_after_s": idle_s, "problems": problems}


def _barrier_wait(b: threading.Barrier) -> None:
    try:
        b.wait()
    except threading.BrokenBarrierError:
        pass


# ------------------------------------------------------------------------------------------------
# Scenario: worker kill mid-stream (the long script only; tests/serve covers worker death in CI)
# ------------------------------------------------------------------------------------------------


def run_worker_kill(base_url: str, model: str, rd: RayDriver, app: str, max_model_len: int, streams: int = 4,
                    recover_timeout: float = 240.0) -> dict:
    """Kill the app's TP worker actors while `streams` streams are decoding. Measured: seconds from
    the kill to the first 503 (new requests or /health), how the in-flight streams ended, statuses
    seen during the outage (only 503 + Retry-After is right), seconds until a request succeeds again."""
    started = threading.Barrier(streams + 1, timeout=120)
    ends: dict[int, dict] = {}

    def stream(i: int):
        body = completion(model, [11, 12, 13 + i], min(2000, max_model_len - 8), ignore_eos=True, stream=True,
                          stop_token_ids=FAULT_TOKENS)
        got_first, chunks = False, []
        try:
            _assert_loopback(base_url)
            with requests.post(base_url.rstrip("/") + "/v1/completions", data=dumps(body), headers=JSON,
                               stream=True, timeout=(5, 120)) as r:
                for line in r.iter_lines():
                    chunks.append(line)
                    if not got_first and line.startswith(b"data:"):
                        got_first = True
                        _barrier_wait(started)
            reply = Reply(r.status_code, {}, b"\n".join(chunks), 0)
            err, (_, done) = _sse_error(reply), sse_events(reply.body)
            ends[i] = {"end": time.monotonic(), "error": err, "done": done, "leaks": leaks(reply.text),
                       "status": r.status_code, "started": got_first}
        except requests.RequestException as e:
            ends[i] = {"end": time.monotonic(), "error": {"transport": repr(e)[:150]}, "done": False, "leaks": [],
                       "status": None, "started": got_first}
        if not got_first:
            _barrier_wait(started)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    _barrier_wait(started)
    t_kill = time.monotonic()
    killed = rd.kill_workers(app)
    first_503 = recovered = None
    seen: dict[str, int] = {}
    bad_outage: list[str] = []
    deadline = t_kill + recover_timeout
    i = 0
    while time.monotonic() < deadline:
        i += 1
        if i % 2:
            r = send(base_url, HostileRequest("health", "GET", "/health"), 10)
        else:
            r = post_json(base_url, "/v1/completions", completion(model, [11, 12], 2), 30)
        now = time.monotonic()
        seen[str(r.status)] = seen.get(str(r.status), 0) + 1
        if r.status == 503 and first_503 is None:
            first_503 = now - t_kill
        if r.status not in (200, 503) or (r.status == 503 and not _retry_after_ok(r.headers)):
            bad_outage.append(f"{r.status} {r.text[:150] or r.transport_error}")
        elif r.status is not None and r.status >= 400:
            found = leaks(r.text)
            if found:
                bad_outage.append(f"leak {found}: {r.text[:150]}")
        if r.status == 200 and i % 2 == 0 and first_503 is not None:
            recovered = now - t_kill
            break
        time.sleep(0.05 if first_503 is None else 0.5)
    for t in threads:
        t.join(60)
    stream_end = [round(e["end"] - t_kill, 2) for e in ends.values()]
    return {"workers_killed": killed, "first_503_s": None if first_503 is None else round(first_503, 3),
            "recovered_s": None if recovered is None else round(recovered, 1), "statuses_during": seen,
            "bad_during_outage": bad_outage[:5], "bad_during_outage_count": len(bad_outage), "streams": streams,
            "streams_running_at_kill": sum(1 for e in ends.values() if e["started"] and e["end"] > t_kill),
            "streams_ended_with_error_event": sum(1 for e in ends.values() if e["error"] and e["done"]),
            "streams_ended_by_transport": sum(1 for e in ends.values() if e["error"] and "transport" in e["error"]),
            "streams_leaking": sum(1 for e in ends.values() if e["leaks"]),
            "stream_end_after_kill_s": stream_end}


# ------------------------------------------------------------------------------------------------
# Scenario: soak
# ------------------------------------------------------------------------------------------------


def run_soak(apps: dict[str, tuple[str, str]], rd: RayDriver, minutes: float, concurrency: int = 4,
             sample_every: float = 5.0, seed: int = 0, max_requests: int = 1_000_000) -> dict:
    """Steady load on `apps` ({app: (base_url, model)}) for `minutes`; counts errors and samples the
    RSS and open fds of every serving process (Routers, TP workers, ingresses, the proxy) via psutil.
    The first samples are taken after a warm-up (10% of the time, 10..60 s)."""
    import psutil
    total = minutes * 60.0
    warmup = min(60.0, max(10.0, 0.1 * total))
    procs = {label: psutil.Process(pid) for label, pid in rd.serving_processes(apps).items()}
    samples: dict[str, list[tuple[float, int, int]]] = {k: [] for k in procs}
    stop = threading.Event()
    counts = {"requests": 0, "errors": 0}
    errors: list[str] = []
    lock = threading.Lock()
    t0 = time.monotonic()
    t_end = t0 + warmup + total
    names = sorted(apps)

    def client(k: int):
        rng = random.Random(seed * 1000 + k)
        while not stop.is_set() and time.monotonic() < t_end:
            with lock:
                if counts["requests"] >= max_requests:
                    return
                counts["requests"] += 1
            app = names[rng.randrange(len(names))]
            base, model = apps[app]
            r_kind = rng.randrange(4)
            mt = rng.randint(4, 24)
            common = dict(stop_token_ids=FAULT_TOKENS, ignore_eos=True, seed=rng.randrange(1000))
            if r_kind == 0:
                path, body = "/v1/completions", completion(model, _ids(rng, rng.randint(4, 64)), mt, **common)
            elif r_kind == 1:
                path, body = "/v1/completions", completion(model, "soak " * rng.randint(1, 30), mt, stream=True,
                                                           **common)
            elif r_kind == 2:
                path, body = "/v1/chat/completions", chat(model, "hello " * rng.randint(1, 20), mt, **common)
            else:
                path, body = "/v1/chat/completions", chat(model, "stream", mt, stream=True, n=2, **common)
            reply = post_json(base, path, body, 120)
            what, detail = classify_generation(reply, mt)
            if what != "completed":
                with lock:
                    counts["errors"] += 1
                    if len(errors) < 10:
                        errors.append(f"{app}{path}: {detail}")

    def sampler():
        while not stop.is_set() and time.monotonic() < t_end:
            if time.monotonic() - t0 >= warmup:
                for label, p in procs.items():
                    try:
                        samples[label].append((time.monotonic() - t0, p.memory_info().rss, p.num_fds()))
                    except psutil.Error:
                        samples[label].append((time.monotonic() - t0, -1, -1))
            stop.wait(sample_every)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    st = threading.Thread(target=sampler)
    for t in threads + [st]:
        t.start()
    try:
        for t in threads:
            t.join(t_end - time.monotonic() + 180)
    finally:
        stop.set()
        st.join(30)
    per_proc = {}
    for label, xs in samples.items():
        good = [x for x in xs if x[1] > 0]
        if len(good) < 2 or len(good) < len(xs):
            per_proc[label] = {"error": "process gone or unsampled", "samples": len(xs)}
            continue
        k = max(1, min(3, len(good) // 4))
        rss0 = statistics.median(x[1] for x in good[:k])
        rss1 = statistics.median(x[1] for x in good[-k:])
        fd0 = statistics.median(x[2] for x in good[:k])
        fd1 = statistics.median(x[2] for x in good[-k:])
        per_proc[label] = {"rss_start_mb": round(rss0 / 2**20, 1), "rss_end_mb": round(rss1 / 2**20, 1),
                           "rss_growth": round((rss1 - rss0) / rss0, 4), "fds_start": fd0, "fds_end": fd1,
                           "samples": len(good)}
    growth = [v["rss_growth"] for v in per_proc.values() if "rss_growth" in v]
    fd_growth = [v["fds_end"] - v["fds_start"] for v in per_proc.values() if "fds_end" in v]
    return {"minutes": minutes, "warmup_s": warmup, "concurrency": concurrency, **counts, "error_examples": errors,
            "processes": per_proc, "max_rss_growth": max(growth) if growth else None,
            "max_fd_growth": max(fd_growth) if fd_growth else None,
            "all_processes_sampled": all("rss_growth" in v for v in per_proc.values()) and bool(per_proc)}


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
    if path not in GENERATION_PATHS or not isinstance(body, dict):
        return body
    body = dict(body)
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
    if "n" in body and "best_of" in body and isinstance(body.get("best_of"), int):
        body["best_of"] = body["n"]
    v = body.get("min_tokens")
    if isinstance(v, int) and not isinstance(v, bool) and v > limit:
        body["min_tokens"] = limit
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
    return out


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


# ------------------------------------------------------------------------------------------------
# Figures
# ------------------------------------------------------------------------------------------------


@dataclass
class Figure:
    name: str
    value: str
    target: str
    passed: bool

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'}  {self.name}: {self.value}  (target: {self.target})"

    def as_dict(self) -> dict:
        return {"name": self.name, "value": self.value, "target": self.target, "pass": self.passed}
