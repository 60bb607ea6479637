"""Async scheduling through Serve (the "async" app: the engine host in rank 0's actor launches step N+1
before reading step N's tokens) answers exactly what the default app answers: greedy tokens and
logprobs, seeded sampling with n, a stop string (the extra in-flight token is discarded), streaming ==
non-streaming, and it goes on after a client drops a stream mid-way."""
from __future__ import annotations

import pytest
import torch
from openai import OpenAI


def _client(app):
    return OpenAI(base_url=app.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def _prompt(n):
    return torch.randint(10, 1000, (n,), generator=torch.Generator().manual_seed(100 + n)).tolist()


@pytest.fixture
def async_app(serve_cluster):
    return serve_cluster.apps["async"]


def _both(tiny_server, async_app, **kw):
    return [_client(a).completions.create(model=a.model, **kw) for a in (tiny_server, async_app)]


@pytest.mark.parametrize("n", [5, 30])
def test_greedy_and_logprobs_equal_the_default_app(tiny_server, async_app, n):
    a, b = _both(tiny_server, async_app, prompt=_prompt(n), max_tokens=16, temperature=0, logprobs=2,
                 extra_body={"ignore_eos": True})
    x, y = a.choices[0], b.choices[0]
    assert x.text == y.text and x.logprobs.tokens == y.logprobs.tokens and y.finish_reason == "length"
    assert max(abs(p - q) for p, q in zip(x.logprobs.token_logprobs, y.logprobs.token_logprobs)) < 1e-5
    assert a.usage.completion_tokens == b.usage.completion_tokens == 16


def test_seeded_n_and_stop_string_equal_the_default_app(tiny_server, async_app):
    a, b = _both(tiny_server, async_app, prompt=_prompt(9), max_tokens=10, temperature=0.9, seed=5, n=2,
                 extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(a.choices, key=lambda c: c.index)] == \
           [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    full = _client(tiny_server).completions.create(model=tiny_server.model, prompt=_prompt(12), max_tokens=16,
                                                   temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    a, b = _both(tiny_server, async_app, prompt=_prompt(12), max_tokens=16, temperature=0, stop=[stop],
                 extra_body={"ignore_eos": True})
    assert a.choices[0].text == b.choices[0].text and b.choices[0].finish_reason == "stop"
    assert a.usage.completion_tokens == b.usage.completion_tokens


def test_streaming_equals_full_and_survives_a_dropped_stream(async_app):
    c, m = _client(async_app), async_app.model
    full = c.completions.create(model=m, prompt=_prompt(7), max_tokens=12, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    s = c.completions.create(model=m, prompt=_prompt(7), max_tokens=12, temperature=0, stream=True,
                             extra_body={"ignore_eos": True})
    assert "".join(x.choices[0].text for x in s if x.choices) == full
    dropped = c.completions.create(model=m, prompt=_prompt(20), max_tokens=200, temperature=0, stream=True,
                                   extra_body={"ignore_eos": True})
    for i, _ in enumerate(dropped):
        if i == 2:
            break
    dropped.close()                                        # the client goes away mid-stream
    again = c.completions.create(model=m, prompt=_prompt(7), max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True}).choices[0].text
    assert again == full
