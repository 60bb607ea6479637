"""End-to-end tests of the OpenAI-compatible API with the official `openai` client.

`tiny_server` (tests/conftest.py) is a running app: `.base_url` ("http://127.0.0.1:PORT"), `.model`
(the served model name) and `.max_model_len`. The model is a tiny random checkpoint, so its text is
noise: tests check the machinery (shapes, consistency between endpoints and modes, determinism,
error handling), never the content.
"""
import concurrent.futures
import json
import time

import openai
import pytest
import requests

TIMEOUT = 180

# Completions ask for a fixed number of tokens so streamed / non-streamed / stopped runs compare. Chat runs
# with thinking off, so the text is `content` (GLM-5's default, thinking on, makes it `reasoning_content`).
FIXED = {"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def srv(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="EMPTY", max_retries=0, timeout=TIMEOUT)


def post(srv, path, body=None, data=None, headers=None, timeout=TIMEOUT, **kw):
    if data is not None:
        return requests.post(srv.base_url + path, data=data, headers=headers or {}, timeout=timeout, **kw)
    return requests.post(srv.base_url + path, json=body, timeout=timeout, **kw)


def assert_openai_error(resp, status, param=None, code=None):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def assert_alive(client, srv):
    """After any bad input the server still serves a good request."""
    r = client.completions.create(model=srv.model, prompt="still alive?", max_tokens=2, temperature=0)
    assert len(r.choices) == 1 and r.usage.completion_tokens >= 1


def greedy_completion(client, srv, prompt="The quick brown fox", max_tokens=16, **kw):
    return client.completions.create(model=srv.model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body=dict(FIXED, **kw.pop("extra_body", {})), **kw)


def tokenize(srv, text, **kw):
    r = post(srv, "/tokenize", dict({"model": srv.model, "prompt": text}, **kw))
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(resp):
    """Parsed `data:` payloads of an SSE response (stops at [DONE], which must come last)."""
    events, done = [], False
    for line in resp.iter_lines():
        if not line:
            continue
        assert line.startswith(b"data: "), line
        payload = line[len(b"data: "):]
        if payload == b"[DONE]":
            done = True
            break
        events.append(json.loads(payload))
    assert done, "stream did not end with data: [DONE]"
    return events


# ----------------------------------------------------------------------------- models / health


def test_models(client, srv):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [srv.model]
    card = requests.get(srv.base_url + f"/v1/models/{srv.model}", timeout=TIMEOUT).json()
    assert card["id"] == srv.model and card["object"] == "model"
    assert card["max_model_len"] == srv.max_model_len
    r = requests.get(srv.base_url + "/v1/models/no-such-model", timeout=TIMEOUT)
    assert_openai_error(r, 404, code="model_not_found")


def test_health(srv):
    r = requests.get(srv.base_url + "/health", timeout=TIMEOUT)
    assert r.status_code == 200


def test_unknown_route_is_openai_shaped_404(srv):
    assert_openai_error(requests.get(srv.base_url + "/v1/nope", timeout=TIMEOUT), 404)


# ----------------------------------------------------------------------------- basic generation


def test_completion(client, srv):
    r = client.completions.create(model=srv.model, prompt="Hello, my name is", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == srv.model
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0 and isinstance(c.text, str)
    assert c.finish_reason in ("length", "stop")
    assert 1 <= r.usage.completion_tokens <= 5
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if c.finish_reason == "length":
        assert r.usage.completion_tokens == 5


def test_completion_token_prompt(client, srv):
    ids = tokenize(srv, "Hello there")["tokens"]
    r = client.completions.create(model=srv.model, prompt=ids, max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens == len(ids)
    # text and token prompts of the same tokens give the same greedy output
    r2 = client.completions.create(model=srv.model, prompt="Hello there", max_tokens=3, temperature=0)
    assert r2.usage.prompt_tokens == len(ids)
    assert r.choices[0].text == r2.choices[0].text


def test_model_field_optional(srv):
    r = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == srv.model


def test_chat(client, srv):
    r = client.chat.completions.create(
        model=srv.model, max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}])
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert len(r.choices) == 1
    m = r.choices[0].message
    # GLM-5 thinks by default: the text is the thinking block (`content` only after a `</think>`)
    assert m.role == "assistant" and isinstance(m.reasoning_content or m.content, str)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert 1 <= r.usage.completion_tokens <= 6
    # prompt_tokens matches /tokenize of the same messages
    tok = post(srv, "/tokenize", {"model": srv.model, "messages": [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]}).json()
    assert r.usage.prompt_tokens == tok["count"]


def _said(message) -> tuple:
    """A chat message's text: (reasoning_content, content) — with GLM-5's thinking on by default, the random
    tiny model's words land in the thinking block unless it happens to emit `</think>`."""
    return getattr(message, "reasoning_content", None), message.content


def test_chat_content_parts(client, srv):
    r = client.chat.completions.create(
        model=srv.model, max_tokens=2, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say hi"}]}])
    r2 = client.chat.completions.create(
        model=srv.model, max_tokens=2, temperature=0, messages=[{"role": "user", "content": "Say hi"}])
    assert r.usage.prompt_tokens == r2.usage.prompt_tokens
    assert _said(r.choices[0].message) == _said(r2.choices[0].message) and any(_said(r.choices[0].message))


def test_greedy_is_deterministic(client, srv):
    a = greedy_completion(client, srv, max_tokens=12)
    b = greedy_completion(client, srv, max_tokens=12)
    assert a.choices[0].text == b.choices[0].text
    msgs = [{"role": "user", "content": "Tell me a story"}]
    c1 = client.chat.completions.create(model=srv.model, messages=msgs, max_tokens=10, temperature=0)
    c2 = client.chat.completions.create(model=srv.model, messages=msgs, max_tokens=10, temperature=0)
    assert _said(c1.choices[0].message) == _said(c2.choices[0].message) and any(_said(c1.choices[0].message))


def test_seeded_sampling_is_reproducible(client, srv):
    kw = dict(model=srv.model, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=1234,
              extra_body=FIXED)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_vllm_extra_sampling_params_accepted(client, srv):
    r = client.completions.create(
        model=srv.model, prompt="Hi", max_tokens=4, temperature=0.7, top_p=0.9, presence_penalty=0.1,
        frequency_penalty=0.1, seed=3,
        extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.05, "min_tokens": 2,
                    "skip_special_tokens": True, "include_stop_str_in_output": False, "unknown_field": 1})
    assert r.usage.completion_tokens >= 2


# ----------------------------------------------------------------------------- streaming


def test_stream_completion_with_usage_matches_non_streaming(client, srv):
    full = greedy_completion(client, srv, max_tokens=10)
    chunks = list(client.completions.create(
        model=srv.model, prompt="The quick brown fox", max_tokens=10, temperature=0, extra_body=FIXED,
        stream=True, stream_options={"include_usage": True}))
    assert chunks, "no chunks"
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in body)
    text = "".join(c.choices[0].text for c in body)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert len({c.id for c in chunks}) == 1


def test_stream_chat_with_usage_matches_non_streaming(client, srv):
    msgs = [{"role": "user", "content": "Count to three"}]
    full = client.chat.completions.create(model=srv.model, messages=msgs, max_tokens=8, temperature=0,
                                          extra_body=FIXED)
    chunks = list(client.chat.completions.create(
        model=srv.model, messages=msgs, max_tokens=8, temperature=0, extra_body=FIXED, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == full.usage.completion_tokens
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in body)
    assert content == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]


def test_stream_without_include_usage_has_no_usage(client, srv):
    chunks = list(client.completions.create(model=srv.model, prompt="Hi", max_tokens=3, temperature=0,
                                            stream=True))
    assert chunks and all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


def test_stream_raw_sse_framing(srv):
    r = post(srv, "/v1/chat/completions", {"model": srv.model, "messages": [{"role": "user", "content": "x"}],
                                           "max_tokens": 3, "stream": True}, stream=True)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events and all(e["object"] == "chat.completion.chunk" for e in events)


# ----------------------------------------------------------------------------- n > 1, batches


def test_n_completions(client, srv):
    r = client.completions.create(model=srv.model, prompt="Pick a word:", max_tokens=4, n=3, temperature=1.0,
                                  seed=7, logprobs=0, extra_body=FIXED)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices) == 12
    # the prompt is counted once, not once per choice
    assert r.usage.prompt_tokens == tokenize(srv, "Pick a word:")["count"]


def test_n_greedy_choices_agree(client, srv):
    r = client.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5, n=2, temperature=0)
    assert len(r.choices) == 2 and _said(r.choices[0].message) == _said(r.choices[1].message)
    assert any(_said(r.choices[0].message))


def test_n_streaming_chat(client, srv):
    texts, finishes = {}, {}
    usage = None
    for ch in client.chat.completions.create(
            model=srv.model, messages=[{"role": "user", "content": "hello"}], max_tokens=5, n=3,
            temperature=1.0, seed=11, stream=True, stream_options={"include_usage": True}, extra_body=FIXED):
        if not ch.choices:
            usage = ch.usage
            continue
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                assert c.index not in finishes, "finish_reason sent twice for one choice"
                finishes[c.index] = c.finish_reason
    assert sorted(texts) == [0, 1, 2] and sorted(finishes) == [0, 1, 2]
    assert usage is not None and usage.completion_tokens == 15


def test_batched_prompts(client, srv):
    prompts = ["First prompt", "Second, longer prompt here"]
    r = client.completions.create(model=srv.model, prompt=prompts, max_tokens=3, n=2, temperature=0,
                                  extra_body=FIXED)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == sum(tokenize(srv, p)["count"] for p in prompts)
    assert r.usage.completion_tokens == 12
    by_index = {c.index: c.text for c in r.choices}
    for i, p in enumerate(prompts):       # choices are grouped per prompt: p * n + i
        single = client.completions.create(model=srv.model, prompt=p, max_tokens=3, temperature=0,
                                           extra_body=FIXED)
        assert by_index[2 * i] == by_index[2 * i + 1] == single.choices[0].text


# ----------------------------------------------------------------------------- stop strings


def _pick_stop(text):
    """A 2-3 char window of `text` (not at its very start) such that the text up to and including
    it is stable (no U+FFFD from a partial character)."""
    for width in (3, 2):
        for k in range(1, len(text) - width + 1):
            s = text[k:k + width]
            if "\ufffd" in text[:k + width]:
                break
            if s.strip():
                return s
    return None


def test_stop_string_truncates(client, srv):
    full = greedy_completion(client, srv, max_tokens=24)
    text = full.choices[0].text
    stop = _pick_stop(text)
    if stop is None:
        pytest.skip(f"greedy text too short/undecodable to pick a stop string: {text!r}")
    idx = text.find(stop)
    r = greedy_completion(client, srv, max_tokens=24, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:idx]
    assert stop not in r.choices[0].text
    assert r.usage.completion_tokens <= full.usage.completion_tokens
    # include_stop_str_in_output keeps the stop string
    r = greedy_completion(client, srv, max_tokens=24, stop=stop,
                          extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:idx + len(stop)]
    # streamed output stops at the same place
    chunks = list(client.completions.create(model=srv.model, prompt="The quick brown fox", max_tokens=24,
                                            temperature=0, stop=[stop], extra_body=FIXED, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text[:idx]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_string_in_chat(client, srv):
    msgs = [{"role": "user", "content": "Write something"}]
    full = client.chat.completions.create(model=srv.model, messages=msgs, max_tokens=24, temperature=0,
                                          extra_body=FIXED)
    text = full.choices[0].message.content
    stop = _pick_stop(text)
    if stop is None:
        pytest.skip(f"greedy text too short/undecodable to pick a stop string: {text!r}")
    r = client.chat.completions.create(model=srv.model, messages=msgs, max_tokens=24, temperature=0,
                                       stop=[stop], extra_body=FIXED)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[:text.find(stop)]


# ----------------------------------------------------------------------------- logprobs


def test_completion_logprobs(client, srv):
    r = greedy_completion(client, srv, max_tokens=6, logprobs=3)
    c = r.choices[0]
    lp = c.logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert isinstance(tok, str)
        assert val <= 0.0
        assert 1 <= len(top) <= 4                      # top-3 plus the sampled token
        assert all(v <= 0.0 for v in top.values())
        # greedy: the sampled token is the most likely one
        assert val >= max(top.values()) - 1e-3


def test_chat_logprobs(client, srv):
    r = client.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                                       extra_body=FIXED)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert isinstance(e.token, str) and e.logprob <= 0.0
        assert e.bytes is not None and all(0 <= b < 256 for b in e.bytes)
        assert len(e.top_logprobs) == 3
        vals = [t.logprob for t in e.top_logprobs]
        assert vals == sorted(vals, reverse=True) and all(v <= 0.0 for v in vals)
        assert abs(e.logprob - vals[0]) < 1e-3         # greedy: sampled == most likely
    # logprobs without top_logprobs: entries with no alternatives
    r = client.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=3, temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)
    # no logprobs requested -> null
    r = client.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, temperature=0)
    assert r.choices[0].logprobs is None


def test_stream_logprobs_match_non_streaming(client, srv):
    full = greedy_completion(client, srv, max_tokens=6, logprobs=2)
    toks, vals = [], []
    for ch in client.completions.create(model=srv.model, prompt="The quick brown fox", max_tokens=6,
                                        temperature=0, logprobs=2, extra_body=FIXED, stream=True):
        if ch.choices and ch.choices[0].logprobs:
            toks += ch.choices[0].logprobs.tokens
            vals += ch.choices[0].logprobs.token_logprobs
    assert toks == full.choices[0].logprobs.tokens
    assert vals == pytest.approx(full.choices[0].logprobs.token_logprobs, abs=1e-4)


def test_echo(client, srv):
    prompt = "Echo this prompt"
    n_prompt = tokenize(srv, prompt)["count"]
    r = client.completions.create(model=srv.model, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                  logprobs=1, extra_body=FIXED)
    c = r.choices[0]
    assert c.text.startswith(prompt)
    plain = greedy_completion(client, srv, prompt=prompt, max_tokens=3)
    assert c.text == prompt + plain.choices[0].text
    assert len(c.logprobs.tokens) == n_prompt + r.usage.completion_tokens
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert all(v <= 0.0 for v in c.logprobs.token_logprobs[1:])


def test_prompt_logprobs_and_echo_with_n(client, srv):
    prompt = "Score this prompt please"
    n_prompt = tokenize(srv, prompt)["count"]
    r = client.completions.create(model=srv.model, prompt=prompt, max_tokens=2, temperature=0, echo=True,
                                  logprobs=1, n=2, extra_body=dict(FIXED, prompt_logprobs=1))
    first = r.choices[0].logprobs
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == n_prompt + 2
        assert lp.token_logprobs[0] is None
        assert lp.token_logprobs[1:n_prompt] == pytest.approx(first.token_logprobs[1:n_prompt], abs=1e-5)
        plp = c.prompt_logprobs                     # vLLM extension: [None, {token_id: {logprob, ...}}, ...]
        assert len(plp) == n_prompt and plp[0] is None
        for pos in plp[1:]:
            assert 1 <= len(pos) <= 2
            assert all(v["logprob"] <= 0.0 for v in pos.values())


# ----------------------------------------------------------------------------- bad inputs


def test_negative_max_tokens(client, srv):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=srv.model, prompt="hi", max_tokens=-1)
    assert ei.value.status_code == 400 and ei.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "x"}],
                                       max_completion_tokens=-5)
    assert_alive(client, srv)


def test_unknown_model(client, srv):
    with pytest.raises(openai.NotFoundError) as ei:
        client.chat.completions.create(model="definitely-not-served", messages=[{"role": "user", "content": "x"}])
    assert ei.value.status_code == 404 and ei.value.code == "model_not_found"
    assert_alive(client, srv)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_malformed_json(client, srv, path):
    r = post(srv, path, data=b'{"model": "x", "prompt": ', headers={"Content-Type": "application/json"})
    assert_openai_error(r, 400)
    r = post(srv, path, data=b"not json at all", headers={"Content-Type": "application/json"})
    assert_openai_error(r, 400)
    assert_alive(client, srv)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [10 ** 9]}, "prompt"),
    ({}, "prompt"),
])
def test_bad_completion_params(client, srv, body, param):
    assert_openai_error(post(srv, "/v1/completions", dict(body, model=srv.model)), 400, param=param)
    assert_alive(client, srv)


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
])
def test_bad_chat_params(client, srv, body, param):
    assert_openai_error(post(srv, "/v1/chat/completions", dict(body, model=srv.model)), 400, param=param)
    assert_alive(client, srv)


def test_prompt_longer_than_context(client, srv):
    unit = tokenize(srv, "hello world", add_special_tokens=False)["tokens"]
    ids = (unit * (srv.max_model_len // len(unit) + 2))[: srv.max_model_len + 1]
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=srv.model, prompt=ids, max_tokens=1)
    assert ei.value.status_code == 400 and ei.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=srv.model, max_tokens=1,
                                       messages=[{"role": "user", "content": "hello world " * srv.max_model_len}])
    # prompt fits but prompt + max_tokens does not
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=srv.model, prompt="hi", max_tokens=srv.max_model_len)
    assert ei.value.code == "context_length_exceeded"
    assert_alive(client, srv)


# ----------------------------------------------------------------------------- tokenizer endpoints


def test_tokenize_detokenize_round_trip(srv):
    text = "Hello world, this is a round trip: 123 456."
    t = tokenize(srv, text, add_special_tokens=False, return_token_strs=True)
    assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] == srv.max_model_len
    assert len(t["token_strs"]) == t["count"]
    d = post(srv, "/detokenize", {"model": srv.model, "tokens": t["tokens"]})
    assert d.status_code == 200 and d.json()["prompt"] == text
    # with the tokenizer's special tokens the text is still contained
    t2 = tokenize(srv, text)
    d2 = post(srv, "/detokenize", {"model": srv.model, "tokens": t2["tokens"]}).json()["prompt"]
    assert text in d2
    assert_openai_error(post(srv, "/detokenize", {"model": srv.model, "tokens": [-1]}), 400, param="tokens")
    assert_openai_error(post(srv, "/tokenize", {"model": "nope", "prompt": "x"}), 404, code="model_not_found")


def test_tokenize_chat(srv):
    t = post(srv, "/tokenize", {"model": srv.model, "messages": [{"role": "user", "content": "hi"}]}).json()
    t_no_gen = post(srv, "/tokenize", {"model": srv.model, "messages": [{"role": "user", "content": "hi"}],
                                       "add_generation_prompt": False}).json()
    assert t["count"] > 0 and t_no_gen["count"] <= t["count"]


# ----------------------------------------------------------------------------- disconnects


def _long_body(srv, stream):
    return {"model": srv.model, "prompt": "Tell me everything", "temperature": 0, "ignore_eos": True,
            "max_tokens": max(8, min(512, srv.max_model_len - 32)), "n": 2, "stream": stream}


def test_stream_closed_early_then_server_still_serves(client, srv):
    for _ in range(3):
        r = post(srv, "/v1/completions", _long_body(srv, True), stream=True)
        assert r.status_code == 200
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith(b"data: "):
                got += 1
                if got >= 2:
                    break
        r.close()                                      # client goes away mid-stream
    t0 = time.monotonic()
    assert_alive(client, srv)
    assert time.monotonic() - t0 < TIMEOUT


def test_non_streaming_client_timeout_then_server_still_serves(client, srv):
    try:
        post(srv, "/v1/completions", _long_body(srv, False), timeout=0.5)
    except requests.exceptions.Timeout:
        pass
    assert_alive(client, srv)


def test_concurrent_requests(client, srv):
    def one(i):
        return client.completions.create(model=srv.model, prompt=f"Request number {i}", max_tokens=4,
                                         temperature=0, extra_body=FIXED)

    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        results = list(ex.map(one, range(6)))
    assert all(r.usage.completion_tokens == 4 for r in results)
    assert len({r.id for r in results}) == 6
