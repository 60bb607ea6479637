"""`response_format` through the served app with the official `openai` client: every `json_schema` answer
of the random tiny model validates against the schema (`jsonschema`, an independent validator; and the
SDK's own `parse`, which builds a strict schema from a pydantic model and validates the answer with
it), streamed answers too; `json_object` answers that end are JSON objects; async scheduling gives
the default app's answers; bad schemas and bad combinations are 400s in OpenAI's error shape naming
the field. The default app of the session's test cluster (tests/conftest.py)."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest
import requests
from pydantic import BaseModel, Field

from glm_ray.serve.protocol import ChatCompletionRequest, parse_body, to_sampling_params

PERSON = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
                         "ok": {"type": "boolean"}},
          "required": ["name", "age", "color", "tags", "ok"]}
# the longest answer PERSON admits, every character its own (up to 4-byte) token, fits in 256 tokens
MAX_TOKENS = 256
# GLM-5 thinks by default: the answer (the constrained part) follows the thinking block, which the random
# model would not close; these requests answer directly
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def _client(app):
    return openai.OpenAI(base_url=app.base_url + "/v1", api_key="EMPTY", max_retries=0, timeout=300)


def _fmt(schema=PERSON):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def _ask(app, i, **kw):
    kw.setdefault("response_format", _fmt())
    kw.setdefault("extra_body", NO_THINKING)
    kw.setdefault("temperature", 1.0)
    kw.setdefault("max_tokens", MAX_TOKENS)
    return _client(app).chat.completions.create(
        model=app.model, messages=[{"role": "user", "content": f"Describe person number {i} as JSON."}],
        seed=i, **kw)


def test_protocol_maps_response_format():
    def sp(rf, **kw):
        body = {"messages": [{"role": "user", "content": "hi"}], "response_format": rf, **kw}
        return to_sampling_params(parse_body(json.dumps(body), ChatCompletionRequest), 10)
    assert sp({"type": "text"}).structured_outputs is None
    assert sp({"type": "json_object"}).structured_outputs.json_object is True
    assert json.loads(sp(_fmt()).structured_outputs.json) == PERSON


def test_100_json_schema_answers_validate(tiny_server):
    with ThreadPoolExecutor(16) as ex:
        answers = list(ex.map(lambda i: _ask(tiny_server, i), range(100)))
    texts = []
    for r in answers:
        ch = r.choices[0]
        assert ch.finish_reason == "stop", ch.message.content        # the grammar ends a bounded schema
        jsonschema.validate(json.loads(ch.message.content), PERSON)
        texts.append(ch.message.content)
    assert len(set(texts)) > 50                                       # random answers, not one repeated


class Pet(BaseModel):
    name: str = Field(max_length=10)
    legs: int = Field(ge=0, le=8)
    kind: Literal["cat", "dog", "bird"]
    vaccinated: bool


def test_the_sdk_parses_pydantic_answers(tiny_server):
    c = _client(tiny_server)
    for i in range(4):
        r = c.chat.completions.parse(model=tiny_server.model, messages=[{"role": "user", "content": f"pet {i}"}],
                                     response_format=Pet, max_tokens=MAX_TOKENS, temperature=1.0, seed=i,
                                     extra_body=NO_THINKING)
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(r.choices[0].message.parsed, Pet)


def test_streamed_json_schema_answer_validates_and_equals_the_full_one(tiny_server):
    full = _ask(tiny_server, 7).choices[0].message.content
    stream = _ask(tiny_server, 7, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == full
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_answers_that_end_are_objects(tiny_server):
    with ThreadPoolExecutor(8) as ex:
        answers = list(ex.map(lambda i: _ask(tiny_server, i, response_format={"type": "json_object"},
                                             max_tokens=300), range(24)))
    ended = [r.choices[0].message.content for r in answers if r.choices[0].finish_reason == "stop"]
    assert ended, "none of 24 random answers closed its object within 300 tokens"
    for text in ended:
        assert isinstance(json.loads(text), dict)
    for r in answers:
        assert r.choices[0].message.content.startswith("{")           # cut by length: still an object's start


def test_async_scheduling_answers_the_same(tiny_server, serve_cluster):
    asyn = serve_cluster.apps["async"]
    for i in (3, 4):
        a = _ask(tiny_server, i, temperature=0).choices[0].message.content
        assert _ask(asyn, i, temperature=0).choices[0].message.content == a
        jsonschema.validate(json.loads(a), PERSON)


@pytest.mark.parametrize("body,param", [
    ({"response_format": _fmt({"type": "frobnicate"})}, "response_format"),
    ({"response_format": _fmt({"properties": {"a": {"type": "string", "pattern": "(unclosed"}}, "type": "object"})},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens"),
])
def test_bad_formats_are_400s_naming_the_field(tiny_server, body, param):
    extra = {k: v for k, v in body.items() if k != "response_format"}
    with pytest.raises(openai.BadRequestError) as ei:
        _client(tiny_server).chat.completions.create(
            model=tiny_server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            response_format=body["response_format"], extra_body={**NO_THINKING, **extra})
    e = ei.value
    assert e.status_code == 400
    assert set(e.body) >= {"message", "type", "param", "code"} and e.body["param"] == param, e.body
    assert e.body["message"]


# ---- chat turns: the constraint and GLM-5's thinking block, tool_choice required / named ---------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False,
        "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 6},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False,
    "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_constrained_tool_choice_always_calls_a_tool(tiny_server, tool_choice):
    """tool_choice "required" / named: the random model's every answer is a call of an allowed tool whose
    arguments validate against that tool's schema, finish_reason "tool_calls"."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}

    def ask(i):
        return _client(tiny_server).chat.completions.create(
            model=tiny_server.model, messages=[{"role": "user", "content": f"Question {i}?"}], tools=[WEATHER, CLOCK],
            tool_choice=tool_choice, parallel_tool_calls=False, temperature=1.0, seed=i, max_tokens=MAX_TOKENS,
            extra_body=NO_THINKING)
    with ThreadPoolExecutor(8) as ex:
        answers = list(ex.map(ask, range(16)))
    for r in answers:
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch.message
        assert len(ch.message.tool_calls) == 1
        call = ch.message.tool_calls[0].function
        if isinstance(tool_choice, dict):
            assert call.name == "get_time"
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_response_format_applies_after_the_thinking_block(tiny_server):
    """Thinking on (GLM-5's default): the thinking stays free text and the JSON follows `</think>`. The
    test-only forced tokens write a short thinking block and close it; the grammar takes over after."""
    r = requests.post(tiny_server.base_url + "/tokenize",
                      json={"prompt": "Let me think.</think>", "add_special_tokens": False}, timeout=60)
    forced = r.json()["tokens"]
    out = _client(tiny_server).chat.completions.create(
        model=tiny_server.model, messages=[{"role": "user", "content": "A person, please."}],
        response_format=_fmt(), temperature=1.0, seed=3, max_tokens=MAX_TOKENS,
        extra_body={"forced_token_ids": forced})
    m = out.choices[0].message
    assert getattr(m, "reasoning_content", None) == "Let me think."
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(m.content), PERSON)


def test_response_format_with_constrained_tool_choice_is_a_400(tiny_server):
    with pytest.raises(openai.BadRequestError) as e:
        _client(tiny_server).chat.completions.create(
            model=tiny_server.model, messages=[{"role": "user", "content": "x"}], tools=[WEATHER],
            tool_choice="required", response_format=_fmt(), max_tokens=4)
    assert e.value.body["param"] == "tool_choice"
