"""The agent-facing chat API: GLM-5's chat format in the tiny tokenizer, and tool calls / thinking served
through the OpenAI API as the official `openai` client parses them.

Without a cluster: the tiny tokenizer's chat template renders GLM-5's released format (the expected
strings are GLM-4.7/5's published renderings of the same conversations), its markup tokens are single,
non-special tokens, and the test-only output hook is off unless the server enables it.

Served (the default app of the test cluster): the tiny model's text is noise, so a test forces the output
tokens (`forced_token_ids`, honored only because tests/cluster.py starts Ray with
GLM_RAY_TEST_FORCED_OUTPUT=1; a client cannot turn it on) and checks what comes back: `tool_calls`,
`reasoning_content`, `finish_reason`, the stream's delta shapes, the SDK's own stream accumulator.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import openai
import pytest
import requests

from glm_ray.engine.sampling_params import SamplingParams
from glm_ray.model import tiny
from glm_ray.serve.protocol import ChatCompletionRequest, parse_body, template_tools

TIMEOUT = 180
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS_HEADER = ("<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
TOOLS_FOOTER = ("</tools>\n\nFor each function call, output the function name and arguments within the following "
                "XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}"
                "</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>")


# ------------------------------------------------------------------------------- the tiny chat format

@pytest.fixture(scope="module")
def tok():
    return tiny.build_tokenizer(1024)


def render(tok, messages, **kw):
    kw.setdefault("add_generation_prompt", True)
    return tok.apply_chat_template(messages, tokenize=False, **kw)


@pytest.mark.parametrize("messages,kwargs,expected", [
    ([{"role": "user", "content": "Hello"}], {}, "[gMASK]<sop><|user|>Hello<|assistant|><think>"),
    ([{"role": "user", "content": "Hello"}], {"enable_thinking": False}, "[gMASK]<sop><|user|>Hello<|assistant|></think>"),
    ([{"role": "system", "content": "You are helpful."}, {"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
     {}, "[gMASK]<sop><|system|>You are helpful.<|user|>Hello<|assistant|><think>"),
    # reasoning of turns before the last user message is dropped ...
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "reasoning_content": "r1", "content": "Hello there"},
      {"role": "user", "content": "How are you?"}], {},
     "[gMASK]<sop><|user|>Hi<|assistant|></think>Hello there<|user|>How are you?<|assistant|><think>"),
    # ... unless clear_thinking is false (GLM-4.7's preserved thinking)
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "reasoning_content": "r1", "content": "Hello there"},
      {"role": "user", "content": "How are you?"}], {"clear_thinking": False},
     "[gMASK]<sop><|user|>Hi<|assistant|><think>r1</think>Hello there<|user|>How are you?<|assistant|><think>"),
    # reasoning after the last user message is kept; reasoning written into content is split out
    ([{"role": "user", "content": "Answer with reasoning."}, {"role": "assistant", "content": "<think>Plan.</think>Done."}],
     {"add_generation_prompt": False}, "[gMASK]<sop><|user|>Answer with reasoning.<|assistant|><think>Plan.</think>Done."),
])
def test_chat_format(tok, messages, kwargs, expected):
    assert render(tok, messages, **kwargs) == expected


def test_tools_calls_and_results_render_as_glm5(tok):
    messages = [{"role": "user", "content": "Compare weather"},
                {"role": "assistant", "content": "Let me check",
                 "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Tokyo", "days": 2}}},
                                {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": '{"temperature":22}'}, {"role": "tool", "content": '{"temperature":18}'},
                {"role": "assistant", "content": "Tokyo is warmer."}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter für eine Stadt",
                                               "parameters": {"type": "object"}}}]
    tool_json = ('{"type": "function", "function": {"name": "get_weather", "description": "Wetter für eine Stadt", '
                 '"parameters": {"type": "object"}}}')
    assert render(tok, messages, tools=tools) == (
        "[gMASK]<sop>" + TOOLS_HEADER + tool_json + "\n" + TOOLS_FOOTER +
        "<|user|>Compare weather<|assistant|></think>Let me check"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Tokyo</arg_value><arg_key>days</arg_key>"
        "<arg_value>2</arg_value></tool_call><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "</tool_call><|observation|><tool_response>{\"temperature\":22}</tool_response><tool_response>"
        "{\"temperature\":18}</tool_response><|assistant|></think>Tokyo is warmer.<|assistant|><think>")


def test_openai_shaped_history_renders_through_the_request_model(tok):
    """Clients send a call's arguments as a JSON string (OpenAI's wire form); the template sees the object."""
    body = {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "tools": [WEATHER_TOOL]}
    req = parse_body(json.dumps(body), ChatCompletionRequest)
    out = render(tok, req.template_messages(), tools=template_tools(req.tools))
    assert out.endswith("<|user|>Weather in Paris?<|assistant|></think><tool_call>get_weather<arg_key>city</arg_key>"
                        "<arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
                        "<|observation|><tool_response>sunny</tool_response><|assistant|><think>")
    assert "<tools>\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n</tools>" in out   # as the client sent it


def test_markup_tokens_are_single_and_not_special(tok):
    for t in tiny.MARKUP_TOKENS:
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] < 1024, t
        assert tok.decode(ids, skip_special_tokens=True) == t          # kept in generated text, as GLM's are
    for t in tiny.SPECIAL_TOKENS:
        (i,) = tok.encode(t, add_special_tokens=False)
        assert tok.decode([i], skip_special_tokens=True) == ""
    text = "<think>x</think><tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_cache_key_follows_the_format(monkeypatch):
    key = tiny.tiny_cache_key()
    assert key == tiny.tiny_cache_key() and len(key) == 8
    monkeypatch.setattr(tiny, "CHAT_TEMPLATE", tiny.CHAT_TEMPLATE + "{# v2 #}")
    assert tiny.tiny_cache_key() != key


def test_forced_output_needs_the_server_flag():
    from glm_ray.serve.ingress import OpenAIIngress
    req = parse_body(json.dumps({"messages": [{"role": "user", "content": "x"}], "forced_token_ids": [5, 6]}),
                     ChatCompletionRequest)
    sp = SamplingParams()
    off = OpenAIIngress._forced_output(SimpleNamespace(forced_output=False), req, sp, 1024)
    assert off.forced_token_ids == []                     # production: an unknown field, ignored
    on = OpenAIIngress._forced_output(SimpleNamespace(forced_output=True), req, sp, 1024)
    assert on.forced_token_ids == [5, 6]


def test_sampler_emits_forced_tokens_first():
    import torch

    from glm_ray.worker.sampler import SamplingRow, sample
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    forced = SamplingRow(SamplingParams(forced_token_ids=[7, 9]), None, [1], [], (0,))
    greedy = SamplingRow(SamplingParams(temperature=0), None, [1], [], (0,))
    for want in (7, 9):
        tokens, _ = sample(logits, [forced, greedy])
        assert tokens.tolist() == [want, int(logits[1].argmax())]
        forced.output_ids.append(want)
    tokens, _ = sample(logits, [forced, greedy])          # forced ids used up: sampled again
    assert 0 <= int(tokens[0]) < 50


# ------------------------------------------------------------------------------- served

@pytest.fixture(scope="module")
def srv(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="EMPTY", max_retries=0, timeout=TIMEOUT)


def token_ids(srv, text: str) -> list[int]:
    r = requests.post(srv.base_url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def forced(srv, text: str) -> dict:
    """extra_body making the model write `text`, then <|observation|> (GLM's end of a tool-calling turn)."""
    (eos,) = token_ids(srv, "<|observation|>")
    return {"forced_token_ids": token_ids(srv, text) + [eos]}


ASK = [{"role": "user", "content": "What's the weather in Paris for 3 days?"}]
TOOL_TURN = ("The user wants a forecast.</think>I'll check.<tool_call>get_weather<arg_key>city</arg_key>"
             "<arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>")


def test_tool_call_and_reasoning(client, srv):
    r = client.chat.completions.create(model=srv.model, messages=ASK, tools=[WEATHER_TOOL, TIME_TOOL],
                                       extra_body=forced(srv, TOOL_TURN))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.reasoning_content == "The user wants a forecast."
    assert msg.content == "I'll check."
    (call,) = msg.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}      # days typed by the schema


def test_streamed_tool_call_has_openai_shape_and_adds_up(client, srv):
    extra = forced(srv, TOOL_TURN)
    full = client.chat.completions.create(model=srv.model, messages=ASK, tools=[WEATHER_TOOL], extra_body=extra)
    chunks = list(client.chat.completions.create(model=srv.model, messages=ASK, tools=[WEATHER_TOOL],
                                                 extra_body=extra, stream=True))
    reasoning = content = ""
    calls = []
    finishes = []
    for ch in chunks:
        (c,) = ch.choices
        d = c.delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
        calls += d.tool_calls or []
        if c.finish_reason:
            finishes.append(c.finish_reason)
    assert finishes == ["tool_calls"] and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert reasoning == full.choices[0].message.reasoning_content
    assert content == full.choices[0].message.content
    first, *rest = calls
    assert (first.index, first.type, first.function.name, first.function.arguments) == (0, "function", "get_weather", "")
    assert first.id.startswith("call_")
    assert rest and all(d.index == 0 and d.id is None and d.type is None and d.function.name is None
                        and d.function.arguments for d in rest)
    assert "".join(d.function.arguments for d in rest) == full.choices[0].message.tool_calls[0].function.arguments


def test_sdk_stream_helper_accumulates_the_call(client, srv):
    with client.chat.completions.stream(model=srv.model, messages=ASK, tools=[WEATHER_TOOL],
                                        extra_body=forced(srv, TOOL_TURN)) as stream:
        kinds = {e.type for e in stream}
        final = stream.get_final_completion()
    assert {"tool_calls.function.arguments.delta", "tool_calls.function.arguments.done"} <= kinds
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert final.choices[0].finish_reason == "tool_calls"


def test_thinking_off_is_all_content(client, srv):
    text = "No thinking here.<tool_call>get_time</tool_call>"
    r = client.chat.completions.create(model=srv.model, messages=ASK, tools=[TIME_TOOL],
                                       extra_body={**forced(srv, text), "chat_template_kwargs": {"enable_thinking": False}})
    msg = r.choices[0].message
    assert msg.reasoning_content is None and msg.content == "No thinking here."
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [("get_time", "{}")]


def test_tool_choice_none_named_and_parallel_calls(client, srv):
    two = ("</think><tool_call>get_time</tool_call><tool_call>get_weather<arg_key>city</arg_key>"
           "<arg_value>Rome</arg_value></tool_call>")
    tools = [WEATHER_TOOL, TIME_TOOL]
    none = client.chat.completions.create(model=srv.model, messages=ASK, tools=tools, tool_choice="none",
                                          extra_body=forced(srv, two))
    assert none.choices[0].message.tool_calls == [] and none.choices[0].finish_reason == "stop"
    assert none.choices[0].message.content == two.removeprefix("</think>")
    both = client.chat.completions.create(model=srv.model, messages=ASK, tools=tools, extra_body=forced(srv, two))
    assert [c.function.name for c in both.choices[0].message.tool_calls] == ["get_time", "get_weather"]
    assert len({c.id for c in both.choices[0].message.tool_calls}) == 2
    one = client.chat.completions.create(model=srv.model, messages=ASK, tools=tools, parallel_tool_calls=False,
                                         extra_body=forced(srv, two))
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["get_time"]
    named = client.chat.completions.create(model=srv.model, messages=ASK, tools=tools, extra_body=forced(srv, two),
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}
    assert named.choices[0].message.content == "<tool_call>get_time</tool_call>"


def test_malformed_markup_comes_back_as_text(client, srv):
    bad = "</think>Calling <tool_call>launch_rockets<arg_key>n</arg_key><arg_value>3</arg_value></tool_call> now"
    for stream in (False, True):
        kw = dict(model=srv.model, messages=ASK, tools=[WEATHER_TOOL], extra_body=forced(srv, bad))
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            assert not any(c.choices[0].delta.tool_calls for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            r = client.chat.completions.create(**kw)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
            assert r.choices[0].message.tool_calls == []
        assert text == bad.removeprefix("</think>") and finish == "stop"


def test_several_choices_parse_separately(client, srv):
    r = client.chat.completions.create(model=srv.model, messages=ASK, tools=[WEATHER_TOOL], n=2,
                                       extra_body=forced(srv, TOOL_TURN))
    assert [c.finish_reason for c in r.choices] == ["tool_calls", "tool_calls"]
    ids = [c.message.tool_calls[0].id for c in r.choices]
    assert len(set(ids)) == 2
    assert {c.message.tool_calls[0].function.arguments for c in r.choices} == {'{"city": "Paris", "days": 3}'}


def test_tool_history_is_rendered_into_the_prompt(srv):
    body = {"model": srv.model, "tools": [WEATHER_TOOL], "messages": ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_9", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 3}"}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "sunny, 24C"}]}
    r = requests.post(srv.base_url + "/tokenize", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    d = requests.post(srv.base_url + "/detokenize", json={"tokens": r.json()["tokens"]}, timeout=TIMEOUT).json()
    assert d["prompt"].startswith("[gMASK]<sop>" + TOOLS_HEADER)
    assert d["prompt"].endswith("<|assistant|></think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris"
                                "</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call><|observation|>"
                                "<tool_response>sunny, 24C</tool_response><|assistant|><think>")
    chat = requests.post(srv.base_url + "/v1/chat/completions", json={**body, "max_tokens": 2}, timeout=TIMEOUT)
    assert chat.status_code == 200, chat.text


@pytest.mark.parametrize("extra,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [WEATHER_TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"forced_token_ids": [10**6]}, "forced_token_ids"),
    ({"forced_token_ids": "abc"}, "forced_token_ids"),
])
def test_bad_tool_requests_are_400(srv, extra, param):
    r = requests.post(srv.base_url + "/v1/chat/completions",
                      json={"model": srv.model, "messages": ASK, "max_tokens": 2, **extra}, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
