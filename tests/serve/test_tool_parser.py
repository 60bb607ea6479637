"""The GLM tool-call parser (glm_ray/serve/parsers/tool_calls.py): a table of outputs with their expected
content / calls / arguments (values typed by the tool's JSON schema), malformed markup degrading to text,
and streaming: the text cut at every position (and into random pieces) gives the one-piece result, the
events arrive in OpenAI's order, and every arguments string is a JSON object."""
from __future__ import annotations

import itertools
import json
import random

import pytest

from glm_ray.serve.parsers import ParsedMessage, ToolCallArgs, ToolCallParser, ToolCallStart
from glm_ray.serve.parsers.tool_calls import coerce_argument, schema_types

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
    "metric": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"},
    "note": {"type": ["string", "null"]}, "unit": {"enum": ["C", "F"]}, "when": {"$ref": "#/$defs/date"},
    "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
    "$defs": {"date": {"type": "string"}}}
TOOLS = {"get_weather": WEATHER, "get_time": None, "search": {"type": "object", "properties": {"q": {"type": "string"}}}}


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def parse(text: str, pieces: list[str] | None = None, **kw) -> ParsedMessage:
    p = ToolCallParser(TOOLS, new_id=ids(), **kw)
    events = [e for piece in (pieces if pieces is not None else [text]) for e in p.feed(piece)] + p.finish()
    return ParsedMessage.of(events)


def calls(msg: ParsedMessage) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in msg.tool_calls]


# (output, content, [(name, arguments)])
TABLE = [
    # GLM-4.7 / GLM-5 layout
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>"
     "<arg_value>3</arg_value></tool_call>", "", [("get_weather", {"city": "Paris", "days": 3})]),
    # GLM-4.5 / 4.6 layout: newlines between the tags
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
     "<arg_value>3</arg_value>\n</tool_call>", "", [("get_weather", {"city": "Paris", "days": 3})]),
    # text before, between and after; the whitespace around calls is not content
    ("Let me check.\n<tool_call>get_time</tool_call>\n<tool_call>search<arg_key>q</arg_key><arg_value>x y"
     "</arg_value></tool_call>\nDone.", "Let me check.\nDone.", [("get_time", {}), ("search", {"q": "x y"})]),
    # values typed by the schema
    ("<tool_call>get_weather<arg_key>temp</arg_key><arg_value>2.5</arg_value><arg_key>metric</arg_key>"
     "<arg_value>true</arg_value><arg_key>unit</arg_key><arg_value>C</arg_value><arg_key>limit</arg_key>"
     "<arg_value>7</arg_value><arg_key>note</arg_key><arg_value>null</arg_value></tool_call>", "",
     [("get_weather", {"temp": 2.5, "metric": True, "unit": "C", "limit": 7, "note": None})]),
    # a string parameter keeps digits, quotes, newlines and markup-like text as written, but not the
    # whitespace around it (as a non-string value; the tool-call grammar admits some there)
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>42</arg_value><arg_key>when</arg_key>"
     "<arg_value> \"2024-06-27\"\n\n<b>\r\n </arg_value></tool_call>", "",
     [("get_weather", {"city": "42", "when": "\"2024-06-27\"\n\n<b>"})]),
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>\r\t  </arg_value></tool_call>", "",
     [("get_weather", {"city": ""})]),
    # nested JSON values (objects, arrays), Python literals as a fallback, unicode
    ("<tool_call>get_weather<arg_key>opts</arg_key><arg_value>{\"a\": [1, {\"b\": null}], \"c\": \"<x>\"}"
     "</arg_value><arg_key>tags</arg_key><arg_value>['晴', 2]</arg_value><arg_key>city</arg_key>"
     "<arg_value>北京</arg_value></tool_call>", "",
     [("get_weather", {"opts": {"a": [1, {"b": None}], "c": "<x>"}, "tags": ["晴", 2], "city": "北京"})]),
    # an untyped tool: values read as JSON when they are, else strings
    ("<tool_call>get_time<arg_key>tz</arg_key><arg_value>UTC</arg_value><arg_key>n</arg_key><arg_value>1"
     "</arg_value></tool_call>", "", [("get_time", {"tz": "UTC", "n": 1})]),
    # a value that does not read as its type stays a string
    ("<tool_call>get_weather<arg_key>days</arg_key><arg_value>three</arg_value></tool_call>", "",
     [("get_weather", {"days": "three"})]),
    # a repeated key keeps its first value
    ("<tool_call>search<arg_key>q</arg_key><arg_value>a</arg_value><arg_key>q</arg_key><arg_value>b</arg_value>"
     "</tool_call>", "", [("search", {"q": "a"})]),
    # no markup: content as is (trailing whitespace included)
    ("Just text.\n", "Just text.\n", []),
    # malformed: unknown function, no name, text after the name, a name cut short -> text
    ("<tool_call>rm_rf<arg_key>p</arg_key><arg_value>/</arg_value></tool_call>",
     "<tool_call>rm_rf<arg_key>p</arg_key><arg_value>/</arg_value></tool_call>", []),
    ("<tool_call><arg_key>q</arg_key></tool_call>", "<tool_call><arg_key>q</arg_key></tool_call>", []),
    ("<tool_call>search the web</tool_call>", "<tool_call>search the web</tool_call>", []),
    ("see <tool_call>get_wea", "see <tool_call>get_wea", []),
    ("a </tool_call> b <arg_key>", "a </tool_call> b <arg_key>", []),
    # malformed inside a call: the call ends (arguments valid JSON), the rest is text
    ("<tool_call>search<arg_key>q</arg_key>oops</tool_call>", "oops</tool_call>", [("search", {})]),
    ("<tool_call>search<arg_key>q<arg_value>x</arg_value></tool_call>",
     "q<arg_value>x</arg_value></tool_call>", [("search", {})]),
    ("<tool_call>search<arg_key>q</arg_key><arg_value>x</arg_value>trailing words",
     "trailing words", [("search", {"q": "x"})]),
    # cut off inside a call: it is closed with what arrived (a string value as far as it got)
    ("<tool_call>search<arg_key>q</arg_key><arg_value>partial que", "", [("search", {"q": "partial que"})]),
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value><arg_key>days</arg_key>"
     "<arg_value>1", "", [("get_weather", {"city": "Rome"})]),
    ("<tool_call>get_time", "<tool_call>get_time", []),
    ("<tool_call>get_time\n", "<tool_call>get_time\n", []),
]


@pytest.mark.parametrize("text,content,expected", TABLE)
def test_table(text, content, expected):
    msg = parse(text)
    assert msg.content == content
    assert calls(msg) == expected
    assert [c.id for c in msg.tool_calls] == [f"call_{i}" for i in range(len(expected))]


@pytest.mark.parametrize("text,content,expected", TABLE)
def test_every_split_position_streams_the_same(text, content, expected):
    whole = parse(text)
    for i in range(len(text) + 1):
        assert parse(text, [text[:i], text[i:]]) == whole, i
    assert parse(text, list(text)) == whole


def test_two_cut_splits_of_a_rich_output():
    text = ("Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>São Paulo</arg_value>\n"
            "<arg_key>opts</arg_key><arg_value>{\"x\": [1]}</arg_value></tool_call><tool_call>get_time"
            "</tool_call>\n")
    whole = parse(text)
    assert calls(whole) == [("get_weather", {"city": "São Paulo", "opts": {"x": [1]}}), ("get_time", {})]
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 3):
            assert parse(text, [text[:i], text[i:j], text[j:]]) == whole, (i, j)


def test_events_come_in_openai_order():
    text = ("<tool_call>search<arg_key>q</arg_key><arg_value>long query text</arg_value></tool_call>"
            "<tool_call>get_time</tool_call>")
    p = ToolCallParser(TOOLS, new_id=ids())
    events = [e for ch in text for e in p.feed(ch)] + p.finish()
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [(e.index, e.name) for e in starts] == [(0, "search"), (1, "get_time")]
    for e in events:                     # every fragment after its call's start, never before
        if isinstance(e, ToolCallArgs):
            assert events.index(starts[e.index]) < events.index(e)
    frags = [e.fragment for e in events if isinstance(e, ToolCallArgs) and e.index == 0]
    assert len(frags) > 5, "a string value streams as it arrives"
    assert "".join(frags) == '{"q": "long query text"}'


def test_named_tool_choice_and_parallel_calls_off():
    text = "<tool_call>get_time</tool_call><tool_call>search<arg_key>q</arg_key><arg_value>x</arg_value></tool_call>"
    named = parse(text, allowed=["search"])
    assert calls(named) == [("search", {"q": "x"})] and named.content == "<tool_call>get_time</tool_call>"
    one = parse(text, max_calls=1)
    assert calls(one) == [("get_time", {})] and one.content == ""      # later calls dropped, not text
    for i in range(len(text) + 1):
        assert parse(text, [text[:i], text[i:]], max_calls=1) == one


def test_random_markup_never_breaks_the_json():
    """Fuzz: random mixes of markup pieces, any chunking: no exception, streamed == whole, every
    arguments string a JSON object, and no markup-free text is lost."""
    rng = random.Random(21)
    parts = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
             "get_weather", "search", "get_time", "city", "days", "q", "3", "Paris", "{\"a\": 1}", "[1,",
             " ", "\n", "x", "<", "</", "<tool", "\"", "\\", "1e999", "NaN"]
    for _ in range(3000):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 14)))
        whole = parse(text)
        cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(1, 5)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert parse(text, pieces) == whole, (text, pieces)
        for c in whole.tool_calls:
            assert isinstance(json.loads(c.arguments), dict), (text, c.arguments)
        if "<" not in text and text.strip():
            assert whole.content == text


@pytest.mark.parametrize("raw,schema,want", [
    ("3", {"type": "integer"}, 3), ("3.0", {"type": "integer"}, 3), (" 3 ", {"type": "integer"}, 3),
    ("3", {"type": "number"}, 3), ("2.5", {"type": "number"}, 2.5), ("1e999", {"type": "number"}, "1e999"),
    ("3", {"type": "string"}, "3"), ("true", {"type": "boolean"}, True), ("False", {"type": "boolean"}, False),
    ("None", {"type": "null"}, None), ("null", {"type": ["integer", "null"]}, None),
    ("[1, 2]", {"type": "array"}, [1, 2]), ("{'a': (1)}", {"type": "object"}, {"a": 1}),
    ("{bad", {"type": "object"}, "{bad"), ("x", {"enum": ["x", "y"]}, "x"), ("1", {"enum": [1, 2]}, 1),
    ("7", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, 7),
    ("seven", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, "seven"),
    ("NaN", None, "NaN"), ("{\"k\": 1}", None, {"k": 1}), ("[" * 100000, {"type": "array"}, "[" * 100000),
])
def test_coerce_argument(raw, schema, want):
    got = coerce_argument(raw, schema_types(schema) if schema is not None else None)
    assert got == want and type(got) is type(want)


def test_schema_types_follow_refs_and_survive_cycles():
    root = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "integer"}, "loop": {"$ref": "#/$defs/loop"}}}
    assert schema_types({"$ref": "#/$defs/a"}, root) == {"integer"}
    assert schema_types({"$ref": "#/$defs/loop"}, root) is None
    assert schema_types({"$ref": "#/nowhere"}, root) is None
    assert schema_types({"$ref": "http://example.com/s.json"}, root) is None
    assert schema_types({"allOf": [{"type": ["integer", "string"]}, {"type": "integer"}]}) == {"integer"}
