"""GLM tool calls: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>` -> OpenAI
`tool_calls` (id "call_...", type "function", name, arguments as a JSON object string).

One streaming state machine reads both released layouts: GLM-4.7/5 (`glm47`: no whitespace between the
tags) and GLM-4.5/4.6 (`glm45`: `NAME\\n<arg_key>..</arg_key>\\n<arg_value>..</arg_value>\\n`); whitespace
between tags is skipped, a value is exactly the text between its tags.

Values are typed by the tool's JSON schema (`parameters.properties[K]`, local `$ref`s, `anyOf`/`oneOf`,
`enum`/`const`): a string parameter keeps the raw text (the chat template writes string values raw);
otherwise the text is read as JSON (`3` -> 3 for an integer, objects and arrays parsed; Python literals
as a fallback for objects/arrays, `True`/`None` spellings for booleans/null), and kept as a string when it
does not read as a type the schema allows. `arguments` is `json.dumps` of the values in the order written
(a repeated key keeps its first value); string values stream as they arrive, other values when complete.

A call is committed (its name sent) only once its name is followed by `<arg_key>` or `</tool_call>` and
the name is one the request allows (its tools, or the named `tool_choice`); otherwise the markup stays
text. After that, malformed markup ends the call (its arguments closed as valid JSON) and the rest is
text; an output that ends inside a call closes it the same way (finish_reason says "length"). With
`max_calls` (parallel_tool_calls: false -> 1) later calls are parsed and dropped. Whitespace right before
a call and after the last one is not content; text around calls is.
"""
from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import Callable, Collection, Mapping
from typing import Any

from glm_ray.serve.parsers.base import Content, Event, ToolCallArgs, ToolCallStart, partial_tag

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"
_NAME = re.compile(r"(\s*)([^\s<]*)(\s*)")
MAX_KEY_CHARS = 1024                     # a key longer than this is not markup


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# ---------------------------------------------------------------------------------------------------
# argument typing by JSON schema
# ---------------------------------------------------------------------------------------------------

_JSON_TYPES = {"string", "integer", "number", "boolean", "null", "object", "array"}


def _resolve(schema: Any, root: Any, seen: frozenset[int] = frozenset()) -> Any:
    """`schema` with a local `$ref` ("#/...") followed (cycles and dangling refs give None)."""
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str):
        if id(schema) in seen:
            return None
        seen = seen | {id(schema)}
        ref, target = schema["$ref"], root
        if ref != "#" and not ref.startswith("#/"):
            return None
        try:
            for part in ref[2:].split("/") if ref != "#" else []:
                part = part.replace("~1", "/").replace("~0", "~")
                target = target[int(part)] if isinstance(target, list) else target[part]
        except (KeyError, IndexError, TypeError, ValueError):
            return None
        schema = target
    return schema


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def schema_types(schema: Any, root: Any = None, depth: int = 0) -> set[str] | None:
    """The JSON types a value of `schema` may have; None = unknown (no usable constraint)."""
    root = schema if root is None else root
    schema = _resolve(schema, root)
    if not isinstance(schema, dict) or depth > 16:
        return None
    t = schema.get("type")
    if isinstance(t, str) and t in _JSON_TYPES:
        return {t}
    if isinstance(t, list) and t and all(x in _JSON_TYPES for x in t if isinstance(x, str)):
        return {x for x in t if isinstance(x, str)}
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(values, list) and values:
        return {json_type(v) for v in values}
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            parts = [schema_types(b, root, depth + 1) for b in branches]
            return None if any(p is None for p in parts) else set().union(*parts)
    branches = schema.get("allOf")
    if isinstance(branches, list):
        known = [p for p in (schema_types(b, root, depth + 1) for b in branches) if p is not None]
        if known:
            return set.intersection(*known)
    return None


def property_schema(parameters: Any, key: str) -> Any:
    params = _resolve(parameters, parameters)
    props = params.get("properties") if isinstance(params, dict) else None
    return props.get(key) if isinstance(props, dict) else None


_MISSING = object()


def _finite(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        return False
    return True


def _read_json(text: str) -> Any:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return _MISSING
    return value if _finite(value) else _MISSING


def _read_literal(text: str) -> Any:
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _MISSING
    return value if isinstance(value, (dict, list)) and _finite(value) else _MISSING


def _fits(value: Any, types: set[str]) -> bool:
    t = json_type(value)
    return t in types or (t == "integer" and "number" in types)


def coerce_argument(raw: str, types: set[str] | None) -> Any:
    """One `<arg_value>` text -> its JSON value, typed by the schema's `types` (None = unknown). Whitespace
    around a value is not part of it (GLM's templates write none; the tool-call grammar, xgrammar's
    "glm_xml" style, allows a little there), as vLLM's and sglang's GLM parsers read it."""
    text = raw.strip()
    if types == {"string"}:
        return text
    value = _read_json(text)
    if value is _MISSING and (types is None or types & {"object", "array"}):
        value = _read_literal(text)
    if types is None:
        return text if value is _MISSING else value
    if value is not _MISSING:
        if isinstance(value, float) and value.is_integer() and "integer" in types and "number" not in types:
            value = int(value)
        if _fits(value, types):
            return value
    if "boolean" in types and text in ("True", "False"):
        return text == "True"
    if "null" in types and text == "None":
        return None
    if "string" in types or value is _MISSING:
        return text
    return value


# ---------------------------------------------------------------------------------------------------
# the streaming parser
# ---------------------------------------------------------------------------------------------------

TEXT, NAME, BETWEEN, KEY, AFTER_KEY, VALUE = "text", "name", "between", "key", "after_key", "value"


def _escaped(s: str) -> str:
    """`s` as the inside of a JSON string (escaping is per character, so pieces concatenate)."""
    return json.dumps(s, ensure_ascii=False)[1:-1]


class ToolCallParser:
    """Content text -> Content / ToolCallStart / ToolCallArgs events (see the module docstring).

    tools: function name -> its `parameters` JSON schema (None: untyped).
    allowed: the names a call may use (default: every tool). max_calls: calls reported at most.
    """

    def __init__(self, tools: Mapping[str, Any], allowed: Collection[str] | None = None,
                 max_calls: int | None = None, new_id: Callable[[], str] = new_call_id):
        self.tools = dict(tools)
        self.allowed = frozenset(self.tools if allowed is None else allowed)
        self.max_calls = max_calls
        self.new_id = new_id
        self.state = TEXT
        self.buf = ""
        self.held = ""                   # trailing whitespace of the content, held back
        self.calls = 0                   # calls committed (reported or dropped)
        self.reported = 0                # calls reported (indices 0..reported-1)
        # the call being read
        self._index: int | None = None   # its index, None when dropped (beyond max_calls)
        self._name = ""
        self._keys: set[str] = set()
        self._key = ""
        self._types: set[str] | None = None
        self._skip = False               # this value is not reported (a repeated key / a dropped call)
        self._streaming = False          # a string value being streamed
        self._value_started = False      # a non-whitespace character of the streamed value was sent

    @property
    def called(self) -> bool:
        """Whether any tool call was reported."""
        return self.reported > 0

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self.buf += text
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        while self._step(out, final=True):
            pass
        if self.state == TEXT:
            self._text(out, self.buf)
        elif self.state == VALUE and self._streaming:
            self._args(out, _escaped(self.buf) + '"')
        if self.state != TEXT:
            self._close(out)
        self.buf = ""
        if self.held and not self.calls:
            out.append(Content(self.held))
        self.held = ""
        return out

    # ---- output helpers

    def _text(self, out: list[Event], s: str) -> None:
        if not s:
            return
        s = self.held + s
        body = s.rstrip()
        self.held = s[len(body):]
        if body:
            out.append(Content(body))

    def _args(self, out: list[Event], fragment: str) -> None:
        if self._index is not None and fragment:
            out.append(ToolCallArgs(self._index, fragment))

    def _arg_prefix(self) -> str:
        return ("{" if not self._keys else ", ") + json.dumps(self._key, ensure_ascii=False) + ": "

    def _commit(self, out: list[Event], name: str) -> None:
        self.held = ""                                  # whitespace before a call is not content
        self.calls += 1
        self._name, self._keys, self._streaming = name, set(), False
        if self.max_calls is not None and self.reported >= self.max_calls:
            self._index = None
            return
        self._index = self.reported
        self.reported += 1
        out.append(ToolCallStart(self._index, self.new_id(), name))

    def _close(self, out: list[Event]) -> None:
        """End the call being read: its arguments as a complete JSON object."""
        self._args(out, "}" if self._keys else "{}")
        self.state, self._index, self._streaming = TEXT, None, False

    def _malformed(self, out: list[Event], rest: str) -> bool:
        """Markup inside a call went wrong: close the call; `rest` is read as text again."""
        self._close(out)
        self.buf = rest
        return True

    # ---- the state machine: one transition per call; False = wait for more text

    def _step(self, out: list[Event], final: bool) -> bool:
        buf = self.buf
        if self.state == TEXT:
            i = buf.find(OPEN)
            if i < 0:
                keep = 0 if final else partial_tag(buf, OPEN)
                self._text(out, buf[:len(buf) - keep])
                self.buf = buf[len(buf) - keep:]
                return False
            self._text(out, buf[:i])
            self.state, self.buf = NAME, buf[i + len(OPEN):]
            return True
        if self.state == NAME:
            return self._step_name(out, final)
        if self.state in (BETWEEN, AFTER_KEY):
            head = buf.lstrip()
            tags = (KEY_OPEN, CLOSE) if self.state == BETWEEN else (VALUE_OPEN,)
            for tag in tags:
                if head.startswith(tag):
                    self.buf = head[len(tag):]
                    if tag == CLOSE:
                        self._close(out)
                    elif tag == KEY_OPEN:
                        self.state = KEY
                    else:
                        self._start_value(out)
                    return True
            if not head or (not final and any(t.startswith(head) for t in tags)):
                self.buf = head
                return False
            return self._malformed(out, head)
        if self.state == KEY:
            i = buf.find(KEY_CLOSE)
            if i < 0:
                j = buf.find("<")
                bad = (j >= 0 and not KEY_CLOSE.startswith(buf[j:])) or len(buf) > MAX_KEY_CHARS
                return self._malformed(out, buf) if bad else False
            key = buf[:i].strip()
            if not key or "<" in key:
                return self._malformed(out, buf)
            self._key, self.state, self.buf = key, AFTER_KEY, buf[i + len(KEY_CLOSE):]
            return True
        # VALUE
        i = buf.find(VALUE_CLOSE)
        if i < 0:
            if self._streaming:                  # whitespace around the value is not part of it (as
                keep = partial_tag(buf, VALUE_CLOSE)      # `coerce_argument`): leading dropped, trailing
                body = buf[:len(buf) - keep]              # held back until more text follows it
                if not self._value_started:
                    body = body.lstrip()
                send = body.rstrip()
                if send:
                    self._value_started = True
                    self._args(out, _escaped(send))
                self.buf = body[len(send):] + buf[len(buf) - keep:]
            return False
        self.buf = buf[i + len(VALUE_CLOSE):]
        self._end_value(out, buf[:i])
        self.state = BETWEEN
        return True

    def _step_name(self, out: list[Event], final: bool) -> bool:
        buf = self.buf
        m = _NAME.match(buf)
        name, rest = m.group(2), buf[m.end():]
        if not rest:                                    # the name (or the whitespace after it) may go on
            viable = not name or any(t.startswith(name) for t in self.allowed)
            if not final and viable and not m.group(3):
                return False
            if not final and viable and name in self.allowed:
                return False
        elif name in self.allowed and (rest.startswith(KEY_OPEN) or rest.startswith(CLOSE)):
            self._commit(out, name)
            self.state, self.buf = BETWEEN, rest
            return True
        elif (name in self.allowed and not final and rest.startswith("<")
              and (KEY_OPEN.startswith(rest) or CLOSE.startswith(rest))):
            return False
        # not a call: the markup is text
        self._text(out, OPEN)
        self.state = TEXT
        return True

    def _start_value(self, out: list[Event]) -> None:
        self.state = VALUE
        self._skip = self._index is None or self._key in self._keys
        params = self.tools.get(self._name)
        schema = property_schema(params, self._key)
        self._types = schema_types(schema, params) if schema is not None else None
        self._streaming = self._types == {"string"} and not self._skip
        self._value_started = False
        if self._streaming:
            self._args(out, self._arg_prefix() + '"')
            self._keys.add(self._key)

    def _end_value(self, out: list[Event], raw: str) -> None:
        if self._streaming:
            self._args(out, _escaped(raw.rstrip() if self._value_started else raw.strip()) + '"')
            self._streaming = False
            return
        if self._skip:
            return
        value = coerce_argument(raw, self._types)
        self._args(out, self._arg_prefix() + json.dumps(value, ensure_ascii=False))
        self._keys.add(self._key)

