"""Both places the engine loop can run serve the same thing: the default (inside rank 0's worker actor,
serve/engine_host.py; the "tp2" app: each step handed to rank 1 over gloo) and the Router-hosted engine
(`engine_in_worker: false`, the "inrouter" app, TP=2, a Ray call per step): greedy tokens equal the
default TP=1 app's, logprobs within 1e-4 (TP changes only the reduction order of the partial sums); both
stream, fan out n, go on after a client aborts mid-stream, and answer bad input with 400."""
from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from openai import OpenAI


def _client(app):
    return OpenAI(base_url=app.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def _prompt(n):
    return torch.randint(10, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()


@pytest.fixture(params=["tp2", "inrouter"])
def app(request, serve_cluster):
    return serve_cluster.apps[request.param]


@pytest.mark.parametrize("n", [7, 33])
def test_tp2_in_either_place_matches_tp1(tiny_server, app, n):
    outs = []
    for a in (tiny_server, app):
        r = _client(a).completions.create(model=a.model, prompt=_prompt(n), max_tokens=20, temperature=0,
                                            logprobs=2, extra_body={"ignore_eos": True})
        outs.append(r.choices[0])
    a, b = outs
    assert a.logprobs.tokens == b.logprobs.tokens and a.text == b.text
    assert max(abs(x - y) for x, y in zip(a.logprobs.token_logprobs, b.logprobs.token_logprobs)) < 1e-4


def test_concurrent_streams_and_n(app):
    c = _client(app)
    m = app.model

    def full(n):
        return c.completions.create(model=m, prompt=_prompt(n), max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text

    def streamed(n):
        s = c.completions.create(model=m, prompt=_prompt(n), max_tokens=12, temperature=0, stream=True,
                                 extra_body={"ignore_eos": True})
        return "".join(x.choices[0].text for x in s if x.choices)
    with ThreadPoolExecutor(6) as pool:                   # more than max_num_seqs=4: some wait
        fulls = list(pool.map(full, [5, 9, 12]))
        streams = list(pool.map(streamed, [5, 9, 12]))
    assert fulls == streams
    r = c.completions.create(model=m, prompt=_prompt(8), max_tokens=6, n=3, temperature=1.0, seed=11)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2] and r.usage.completion_tokens == 18


def test_abort_and_bad_input(app):
    c = _client(app)
    s = c.completions.create(model=app.model, prompt=_prompt(9), max_tokens=500, stream=True,
                             extra_body={"ignore_eos": True})
    for i, _ in enumerate(s):
        if i == 3:
            break
    s.close()                                            # client goes away mid-stream
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=app.model, prompt=[10**9], max_tokens=4)
    # the engine goes on serving after the abort and the rejected request
    r = c.completions.create(model=app.model, prompt=_prompt(5), max_tokens=4)
    assert r.choices[0].finish_reason == "length"
    with urllib.request.urlopen(app.base_url + "/health", timeout=30) as h:
        assert h.status == 200
