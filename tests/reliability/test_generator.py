"""The hostile-request generator itself (no server): seeded, and covering every class of hostile
input issue 15 lists."""
from __future__ import annotations

from tests.reliability import harness as H


def _key(r: H.HostileRequest):
    return (r.kind, r.method, r.path, r.body, tuple(sorted(r.headers.items())), r.expect)


def test_same_seed_same_requests_other_seed_other_requests():
    a = H.HostileGenerator(7, "m", 1024, 4096).requests(600)
    b = H.HostileGenerator(7, "m", 1024, 4096).requests(600)
    c = H.HostileGenerator(8, "m", 1024, 4096).requests(600)
    assert [_key(r) for r in a] == [_key(r) for r in b]
    assert [_key(r) for r in a] != [_key(r) for r in c]
    assert len(a) == 600


def test_catalog_covers_the_issue():
    cat = H.HostileGenerator(0, "m", 1024, 4096).catalog()
    kinds = {r.kind for r in cat}
    bodies = b"\n".join(r.body or b"" for r in cat)
    for needed in ("huge_int:seed", "huge_int:top_k", "huge_int:n", "huge_int:max_tokens", "huge_int:logprobs",
                   "nan:temperature", "nan:repetition_penalty", "nesting:body_list", "nesting:messages",
                   "nesting:prompt", "nesting:tokenize_prompt", "surrogate:prompt", "surrogate:chat_content",
                   "surrogate:stop", "surrogate:tokenize", "utf8:ff_fe", "big:prompt_20mb", "chat:role_wizard",
                   "chat:content_null", "chat:content_part", "stop_ids:negative", "stop_ids:vocab_min_tokens",
                   "token_ids:out_of_vocab", "prompt:empty", "big:prompt_over_context", "model:unknown",
                   "ctype:text_plain", "json:truncated", "json:duplicate_keys", "json:not_an_object"):
        assert needed in kinds, needed
    assert any(k.startswith("method:") for k in kinds) and any(k.startswith("path:") for k in kinds)
    assert any(k.startswith("type:") for k in kinds)
    assert b'"seed": 18446744073709551616' in bodies                   # the issue's engine killer
    assert b"NaN" in bodies and b"-Infinity" in bodies and b"\\ud800" in bodies and b"\\udfff" in bodies
    assert max(len(r.body or b"") for r in cat) >= 20 * 2**20
    paths = {r.path for r in cat}
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= paths
    # mutations reach every endpoint, GETs included
    muts = H.HostileGenerator(3, "m", 1024, 4096).requests(len(cat) + 2000)[len(cat):]
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/models", "/health",
            "/v1/models/m"} <= {r.path.split("?")[0] for r in muts}


def test_checker_flags_what_the_contract_forbids():
    ok = H.Reply(400, {"x-request-id": "r1", "content-type": "application/json"},
                 b'{"error": {"message": "bad", "type": "invalid_request_error", "param": null, "code": null}}', 0)
    assert H.check_reply(None, ok) == []
    leaky = H.Reply(503, {"x-request-id": "r1", "content-type": "application/json"},
                    b'{"error": {"message": "the engine is dead: \\u001b[36mray::WorkerActor.execute() (pid=5608, '
                    b'ip=192.0.2.2, actor_id=beae)", "type": "x", "param": null, "code": null}}', 0)
    problems = " ".join(H.check_reply(None, leaky))
    assert "503 without a valid Retry-After" in problems and "leaked internals" in problems
    for name in ("ANSI escape", "ray task name", "pid", "IP address", "actor id"):
        assert name in problems
    assert "422" in " ".join(H.check_reply(None, H.Reply(422, {"x-request-id": "r"}, ok.body, 0)))
    assert "no x-request-id" in " ".join(H.check_reply(None, H.Reply(400, {}, ok.body, 0)))
    busy = b'{"error": {"message": "full", "type": "server_overloaded", "param": null, "code": "server_overloaded"}}'
    retry = H.Reply(503, {"x-request-id": "r", "retry-after": "1", "content-type": "application/json"}, busy, 0)
    assert H.check_reply(None, retry) == []
    dead = H.Reply(503, retry.headers, busy.replace(b'"code": "server_overloaded"', b'"code": "engine_dead"'), 0)
    assert "a server that is down" in " ".join(H.check_reply(None, dead))
    assert H.classify_generation(dead)[0] == "lost" and H.classify_generation(retry)[0] == "rejected"
    stream = H.Reply(200, {"x-request-id": "r", "content-type": "text/event-stream"},
                     b'data: {"choices": []}\n\ndata: {"error": {"message": "x"}}\n\n', 0)
    problems = " ".join(H.check_reply(None, stream))
    assert "[DONE]" in problems and "error event" in problems
    assert H.leaks("model `a.pyramid` not found") == [] and H.leaks('File "/x/y.py", line 3') != []


def test_positive_clamp_keeps_bodies_short_and_valid():
    b = H.clamp_positive_body("/v1/chat/completions", {"messages": [], "n": 100, "min_tokens": 50})
    assert b["max_tokens"] == H.CLAMP_TOKENS and b["n"] == 4 and b["min_tokens"] == H.CLAMP_TOKENS
    b = H.clamp_positive_body("/v1/completions", {"max_tokens": 3, "min_tokens": 2, "best_of": 9, "n": 2})
    assert b["max_tokens"] == 3 and b["min_tokens"] == 2 and b["best_of"] == 2
    assert H.clamp_positive_body("/tokenize", {"max_tokens": 10**9}) == {"max_tokens": 10**9}
