"""Replies and the response contract (OpenAI error shape, no leaked internals, request ids), and
HTTP to the loopback apps: what every reliability scenario sends and checks."""

import json
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional
from urllib.parse import urlsplit

import requests

# ------------------------------------------------------------------------------------------------
# The response checker
# ------------------------------------------------------------------------------------------------

# Internals that must never reach a client (the list). Matched case-sensitively except where
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


