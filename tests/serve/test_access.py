"""Access control on the deployed apps: the API key ("secure" app, `api_key` set) guards /v1/* and
nothing else, the official OpenAI client works with it, and a request-level `chat_template` is refused
where the server does not trust them (the default app) and used where it does ("secure")."""
from __future__ import annotations

import openai
import pytest
import requests

from tests.conftest import SECURE_API_KEY


@pytest.fixture(scope="module")
def secure(serve_cluster):
    return serve_cluster.apps["secure"]


def _chat_body(model, **kw):
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **kw}


def test_v1_needs_the_key_and_only_v1(secure):
    url = secure.base_url
    for path in ("/v1/models", f"/v1/models/{secure.model}"):
        r = requests.get(url + path, timeout=30)
        assert r.status_code == 401, (path, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and "Bearer" in err["message"]
        assert requests.get(url + path, headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
        assert requests.get(url + path, headers={"Authorization": f"Bearer {SECURE_API_KEY}"},
                            timeout=30).status_code == 200
    r = requests.post(url + "/v1/completions", json={"model": secure.model, "prompt": "hi", "max_tokens": 2},
                      timeout=60)
    assert r.status_code == 401
    for path in ("/health", "/version"):                       # open, as in vLLM
        assert requests.get(url + path, timeout=30).status_code == 200
    assert requests.post(url + "/tokenize", json={"prompt": "hi"}, timeout=30).status_code == 200
    # the published schema says which endpoints answer 401
    doc = requests.get(url + "/openapi.json", timeout=30).json()
    assert "401" in doc["paths"]["/v1/completions"]["post"]["responses"]
    assert "401" not in doc["paths"]["/health"]["get"]["responses"]


def test_openai_client_with_the_key(secure):
    client = openai.OpenAI(base_url=secure.base_url + "/v1", api_key=SECURE_API_KEY, max_retries=0)
    out = client.completions.create(model=secure.model, prompt="Hello", max_tokens=3)
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens >= 1
    bad = openai.OpenAI(base_url=secure.base_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_request_chat_template_refused_unless_trusted(tiny_server, secure):
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    r = requests.post(tiny_server.base_url + "/v1/chat/completions",
                      json=_chat_body(tiny_server.model, chat_template=template), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    # trusted: the template really is the one used (the prompt is exactly its rendering)
    r = requests.post(secure.base_url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "chat_template": template}, timeout=30)
    assert r.status_code == 200, r.text
    direct = requests.post(secure.base_url + "/tokenize", json={"prompt": "<<hi>>", "add_special_tokens": False},
                           timeout=30).json()
    assert r.json()["tokens"] == direct["tokens"]
    r = requests.post(secure.base_url + "/v1/chat/completions", json=_chat_body(secure.model, chat_template=template),
                      headers={"Authorization": f"Bearer {SECURE_API_KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    # the sandbox: a template cannot reach Python internals
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    r = requests.post(secure.base_url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "chat_template": evil}, timeout=30)
    assert r.status_code == 400 and "template" in r.json()["error"]["message"]


def test_request_id_header_that_is_not_ascii_is_replaced(tiny_server):
    """Serve's proxy decodes a client's x-request-id as UTF-8 before any app code runs; our proxy
    middleware (serve/proxy_middleware.py) drops one that is not printable ASCII (found by fuzzing:
    `x-request-id: Bearer \\xff` made the proxy answer a bare 500)."""
    import http.client
    from urllib.parse import urlsplit
    u = urlsplit(tiny_server.base_url)
    for value in (b"Bearer \xff", "\u00e9t\u00e9".encode("latin-1"), b"ok-id-123"):
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.putrequest("GET", u.path + "/v1/models")
        conn.putheader(b"x-request-id", value)
        conn.endheaders()
        r = conn.getresponse()
        body = r.read()
        assert r.status == 200, (value, r.status, body[:200])
        rid = r.getheader("x-request-id")
        assert rid and (rid == value.decode() if value == b"ok-id-123" else rid.isascii()), rid
        conn.close()
