"""The seeded hostile-request generator (a catalog of known-bad requests with the statuses that are
right for each, plus seeded mutations of valid bodies) and the fuzz runner."""

import concurrent.futures as cf
import copy
import random
import threading
import time
from typing import Any, Optional

from tests.reliability.client import (
    OVERLOAD_CODES,
    HostileRequest,
    Reply,
    _error_code,
    _retry_after_ok,
    chat,
    check_reply,
    completion,
    dumps,
    is_healthy,
    send,
    wait_healthy,
)

# ------------------------------------------------------------------------------------------------
# The seeded hostile-request generator
# ------------------------------------------------------------------------------------------------

JSON = {"content-type": "application/json"}
DEPTH = 10_000

HUGE_INTS = [2**63, 2**64, 2**64 + 1, 2**100, -(2**63) - 1, -(2**64), 10**30]
NAN_TOKENS = ["NaN", "Infinity", "-Infinity"]
INT_FIELDS = ["n", "seed", "top_k", "max_tokens", "min_tokens", "prompt_logprobs", "logprobs", "best_of"]
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
CHAT_INT_FIELDS = ["n", "seed", "top_k", "max_tokens", "max_completion_tokens", "min_tokens", "top_logprobs",
                   "prompt_logprobs"]
# Body fields a mutation may not delete or set to a *valid* large value: bounds generation time
# (a chat request without max_tokens generates until the context is full: minutes on CPU).
PROTECTED = {"max_tokens", "max_completion_tokens"}


def _nested(depth: int, kind: str = "list") -> str:
    return "[" * depth + "]" * depth if kind == "list" else '{"a":' * depth + "1" + "}" * depth


def _raw(template: dict, key: str, raw_value: str) -> bytes:
    """`template` as JSON with `key` set to a raw JSON text (NaN, a 5000-digit int, deep nesting...)."""
    marker = "__RAW_VALUE_MARKER__"
    return dumps({**template, key: marker}).replace(f'"{marker}"'.encode(), raw_value.encode())


class HostileGenerator:
    """`requests(n)`: the fixed catalog (every class of hostile input the issue lists, each with the
    statuses that are right for it) followed by seeded random mutations of valid bodies for every
    endpoint. The same seed gives the same sequence."""

    def __init__(self, seed: int, model: str, vocab_size: int, max_model_len: int, big_body_mb: int = 20):
        self.seed, self.model, self.V, self.ctx = seed, model, vocab_size or 1024, max_model_len or 4096
        self.big_body_mb = big_body_mb

    # ---- valid bodies (small and quick: max_tokens <= 4) ----
    def valid(self, rng: random.Random) -> tuple[str, str, dict]:
        m = self.model
        choices = [
            ("POST", "/v1/completions", completion(m, "Hello there", 3)),
            ("POST", "/v1/completions", completion(m, [11, 12, 13, 14], 3, temperature=0.7, top_k=5, seed=7)),
            ("POST", "/v1/completions", completion(m, ["a b", "c d"], 2, n=2, logprobs=2, echo=True)),
            ("POST", "/v1/completions", completion(m, "count: 1 2 3", 4, stream=True,
                                                   stream_options={"include_usage": True})),
            ("POST", "/v1/chat/completions", chat(m, "hi", 3)),
            ("POST", "/v1/chat/completions", chat(m, "hi", 3, stream=True, logprobs=True, top_logprobs=2)),
            ("POST", "/v1/chat/completions", {"model": m, "max_completion_tokens": 2, "messages": [
                {"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "x"}]}]}),
            ("POST", "/tokenize", {"model": m, "prompt": "hello world", "return_token_strs": True}),
            ("POST", "/tokenize", {"model": m, "messages": [{"role": "user", "content": "hi"}]}),
            ("POST", "/detokenize", {"model": m, "tokens": [11, 12, 13]}),
            ("GET", "/v1/models", None),
            ("GET", f"/v1/models/{m}", None),
            ("GET", "/health", None),
        ]
        return rng.choice(choices)

    def mutated_get(self, rng: random.Random, path: str) -> HostileRequest:
        """GET endpoints: hostile query strings, path suffixes, bodies, methods and headers."""
        method, body, headers, kinds = "GET", None, {}, []
        for _ in range(rng.randint(1, 2)):
            op = rng.choice(["query", "suffix", "body", "method", "header"])
            kinds.append(op)
            if op == "query":
                path += rng.choice(["?a=%ff%fe", "?model=%00", "?x=" + "y" * 10_000, "?%ED%A0%80=1", "?a[]=1&a[]=2",
                                    "?limit=-1&after=" + "z" * 300, "?&&&==", "?q=%F0%9F%98%80"])
            elif op == "suffix":
                path += rng.choice(["/", "/%ff", "/..", "/%2e%2e%2f", "/" + self._rand_str(rng, 1, 20), "/x" * 200,
                                    "%00", "//"])
            elif op == "body":
                body = rng.choice([dumps({"model": self.model}), b"\xff\xfe", _nested(DEPTH).encode(), b"NaN"])
                headers = dict(JSON)
            elif op == "method":
                method = rng.choice(["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
            elif op == "header":
                headers[rng.choice(["accept", "authorization", "x-request-id", "content-length-x"])] = \
                    rng.choice(["", "Bearer \u00ff", "a" * 8000, "*/*;q=NaN", "\u00e9t\u00e9"]).encode("latin-1",
                                                                                                  "replace").decode("latin-1")
        return HostileRequest("mutation_get:" + "+".join(kinds), method, path, body, headers, None)

    # ---- the catalog ----
    def catalog(self) -> list[HostileRequest]:
        m, V, ctx = self.model, self.V, self.ctx
        cmp = completion(m, "hi", 4)
        cht = chat(m, "hi", 4)
        out: list[HostileRequest] = []

        def add(kind, body, path="/v1/completions", expect=(400,), method="POST", headers=None, note=""):
            if isinstance(body, (dict, list)):
                body = dumps(body)
            elif isinstance(body, str):
                body = body.encode("utf-8", "surrogatepass")
            out.append(HostileRequest(kind, method, path, body, dict(JSON if headers is None else headers),
                                      None if expect is None else frozenset(expect), note))

        # huge ints (the issue's engine killers first)
        add("huge_int:seed", {"model": m, "prompt": "hi", "max_tokens": 4, "seed": 2**64}, expect=(200, 400))
        add("huge_int:top_k", {**cmp, "top_k": 2**63}, expect=(200, 400))
        add("huge_int:n", {**cmp, "n": 10**9})
        add("huge_int:max_tokens", {**cmp, "max_tokens": 2**63})
        add("huge_int:logprobs", {**cmp, "logprobs": -1})
        add("huge_int:logprobs", {**cmp, "logprobs": 1000})
        add("huge_int:top_logprobs", {**cht, "logprobs": True, "top_logprobs": 1000}, "/v1/chat/completions")
        add("huge_int:prompt_logprobs", {**cmp, "prompt_logprobs": 10**6})
        add("huge_int:min_tokens", {**cmp, "min_tokens": 2**63})
        for f in INT_FIELDS:
            for v in (2**64, -(2**63) - 1):
                add(f"huge_int:{f}", {**cmp, f: v}, expect=(200, 400) if f in ("seed", "top_k") else (400,))
        add("huge_int:seed_chat", {**cht, "seed": 2**64 + 1}, "/v1/chat/completions", expect=(200, 400))
        add("huge_int:stream_seed", {**cmp, "seed": 2**64, "stream": True}, expect=(200, 400))
        add("huge_int:5000_digits", _raw(cmp, "seed", "1" + "0" * 5000))
        add("huge_int:5000_digits_max_tokens", _raw(cmp, "max_tokens", "9" * 5000))
        add("huge_int:detokenize", {"model": m, "tokens": [2**64]}, "/detokenize")
        add("huge_int:detokenize_neg", {"model": m, "tokens": [-1]}, "/detokenize")
        # NaN / Infinity as bare JSON tokens
        for f in FLOAT_FIELDS:
            for tok in NAN_TOKENS:
                add(f"nan:{f}", _raw(cmp, f, tok))
        add("nan:temperature_chat", _raw(cht, "temperature", "NaN"), "/v1/chat/completions")
        add("nan:repetition_penalty_chat", _raw(cht, "repetition_penalty", "NaN"), "/v1/chat/completions")
        add("nan:seed", _raw(cmp, "seed", "NaN"))
        add("nan:max_tokens", _raw(cmp, "max_tokens", "Infinity"))
        add("nan:stream", _raw({**cmp, "stream": True}, "temperature", "Infinity"))
        add("nan:body", "NaN")
        # out-of-range floats
        for f, v in (("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("min_p", -0.5), ("min_p", 2.0),
                     ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("presence_penalty", 1e308),
                     ("frequency_penalty", -1e308)):
            add(f"range:{f}", {**cmp, f: v})
        add("range:temperature_huge", {**cmp, "temperature": 1e308}, expect=(200, 400))
        add("range:temperature_tiny", {**cmp, "temperature": 1e-320}, expect=(200, 400))
        # wrong types
        for f, v in (("max_tokens", "four"), ("max_tokens", 4.5), ("max_tokens", [4]), ("n", {"a": 1}),
                     ("temperature", "hot"), ("temperature", [1]), ("stop", 5), ("stop", {"a": "b"}),
                     ("stop", [1, 2]), ("stream", "maybe"), ("stream_options", 5), ("echo", [1]),
                     ("prompt", 5), ("prompt", None), ("prompt", {"text": "hi"}), ("prompt", [1.5]),
                     ("prompt", [[1], "a"]), ("logit_bias", [1]), ("model", 5),
                     ("model", ["glm"]), ("user", {"a": 1}), ("response_format", "json")):
            add(f"type:{f}", {**cmp, f: v})
        for f, v in (("messages", "hi"), ("messages", {"role": "user"}), ("messages", [5]),
                     ("messages", [None]), ("messages", [[]]), ("logprobs", "yes"), ("tools", "x"),
                     ("chat_template_kwargs", [1]), ("max_completion_tokens", "x"), ("top_logprobs", 1.5)):
            add(f"type:chat_{f}", {**cht, f: v}, "/v1/chat/completions",
                expect=(200, 400) if (f, v) == ("logprobs", "yes") else (400,))
        # what pydantic's lax mode coerces (true -> 1, "yes" -> true): accepting it is no bug
        add("type:prompt_bool", {**cmp, "prompt": [True]}, expect=(200, 400))
        add("type:tokenize_prompt", {"model": m, "prompt": 5}, "/tokenize")
        add("type:tokenize_prompt_null", {"model": m, "prompt": None}, "/tokenize")
        add("type:tokenize_messages", {"model": m, "messages": "hi"}, "/tokenize")
        add("type:detokenize_tokens", {"model": m, "tokens": "abc"}, "/detokenize")
        add("type:detokenize_nested", {"model": m, "tokens": [[1]]}, "/detokenize")
        add("type:detokenize_floats", {"model": m, "tokens": [1.5]}, "/detokenize")
        # deep nesting (10k-deep arrays/objects as the body, in messages, in prompt, on /tokenize)
        for kind in ("list", "dict"):
            for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
                add(f"nesting:body_{kind}", _nested(DEPTH, kind), path, expect=(400, 413))
        add("nesting:messages", _raw({"model": m, "max_tokens": 4}, "messages", _nested(DEPTH)),
            "/v1/chat/completions", expect=(400, 413))
        add("nesting:message_content", _raw({"model": m, "max_tokens": 4}, "messages",
                                            '[{"role": "user", "content": ' + _nested(DEPTH) + "}]"),
            "/v1/chat/completions", expect=(400, 413))
        add("nesting:prompt", _raw({"model": m, "max_tokens": 4}, "prompt", _nested(DEPTH)), expect=(400, 413))
        add("nesting:prompt_obj", _raw({"model": m, "max_tokens": 4}, "prompt", _nested(DEPTH, "dict")),
            expect=(400, 413))
        add("nesting:tokenize_prompt", _raw({"model": m}, "prompt", _nested(DEPTH, "dict")), "/tokenize",
            expect=(400, 413))
        add("nesting:tokenize_messages", _raw({"model": m}, "messages", _nested(DEPTH)), "/tokenize",
            expect=(400, 413))
        add("nesting:stop", _raw(cmp, "stop", _nested(DEPTH)), expect=(400, 413))
        add("nesting:chat_template_kwargs", _raw(cht, "chat_template_kwargs", _nested(DEPTH, "dict")),
            "/v1/chat/completions", expect=(400, 413))
        add("nesting:unknown_field", _raw(cmp, "extra", _nested(DEPTH)), expect=(200, 400, 413))
        add("nesting:100k", _nested(100_000), expect=(400, 413))
        # lone UTF-16 surrogates (valid JSON escapes, not valid Unicode)
        ok_or_400 = (200, 400)
        add("surrogate:prompt", {**cmp, "prompt": "hi \ud800"}, expect=ok_or_400)
        add("surrogate:prompt_list", {**cmp, "prompt": ["ok", "\udfff"]}, expect=ok_or_400)
        add("surrogate:chat_content", chat(m, "\udfff", 4), "/v1/chat/completions", expect=ok_or_400)
        add("surrogate:chat_part", chat(m, [{"type": "text", "text": "a\ud800b"}], 4), "/v1/chat/completions",
            expect=ok_or_400)
        add("surrogate:system", {**cht, "messages": [{"role": "system", "content": "\ud800"}, cht["messages"][0]]},
            "/v1/chat/completions", expect=ok_or_400)
        add("surrogate:stop", {**cmp, "stop": ["\ud800"]}, expect=ok_or_400)
        add("surrogate:stop_chat", {**cht, "stop": "\udfff"}, "/v1/chat/completions", expect=ok_or_400)
        add("surrogate:tokenize", {"model": m, "prompt": "\ud800"}, "/tokenize", expect=ok_or_400)
        add("surrogate:tokenize_chat", {"model": m, "messages": [{"role": "user", "content": "x\udfff"}]},
            "/tokenize", expect=ok_or_400)
        add("surrogate:model", {**cmp, "model": "\ud800"}, expect=(400, 404))
        add("surrogate:user", {**cmp, "user": "\ud800"}, expect=ok_or_400)
        add("surrogate:key", '{"model": "%s", "prompt": "hi", "max_tokens": 4, "\\ud800": 1}' % m, expect=ok_or_400)
        add("surrogate:stream", {**cmp, "prompt": "\ud800\udfff\ud800", "stream": True}, expect=ok_or_400)
        add("surrogate:chat_template_kwargs", {**cht, "chat_template_kwargs": {"x": "\ud800"}},
            "/v1/chat/completions", expect=ok_or_400)
        add("surrogate:tool_name", {**cht, "tools": [{"type": "function", "function": {"name": "\ud800"}}]},
            "/v1/chat/completions", expect=ok_or_400)
        # invalid UTF-8 bytes in the body
        for name, bad in (("ff_fe", b"\xff\xfe"), ("lone_continuation", b"\x80"), ("truncated_seq", b"\xc3"),
                          ("overlong", b"\xc0\xaf"), ("encoded_surrogate", b"\xed\xa0\x80"), ("nul", b"\x00")):
            body = dumps(cmp).replace(b'"hi"', b'"hi' + bad + b'"')
            add(f"utf8:{name}", body, expect=(400,) if name != "nul" else (400,))
            add(f"utf8:{name}_tokenize", b'{"prompt": "' + bad + b'"}', "/tokenize", expect=(400,))
        # UTF-16 with a BOM: RFC 8259 wants UTF-8, Python's json detects UTF-16: either answer is sane
        add("utf8:utf16_body", dumps(cmp).decode().encode("utf-16"), expect=(200, 400))
        add("utf8:bom", b"\xef\xbb\xbf" + dumps(cmp), expect=(200, 400))
        # very large bodies
        big = self.big_body_mb * 2**20
        add("big:prompt_20mb", b'{"model": "%s", "max_tokens": 4, "prompt": "' % m.encode() + b"a" * big + b'"}',
            expect=(413,))
        add("big:garbage_20mb", b"x" * big, "/tokenize", expect=(413,))
        add("big:array_20mb", b'{"model": "%s", "tokens": [' % m.encode() + b"1," * (big // 2) + b'1]}',
            "/detokenize", expect=(413,))
        add("big:prompt_over_context", completion(m, [11] * (ctx + 10), 4))
        add("big:text_over_context", completion(m, "word " * (ctx * 4), 4))
        add("big:max_tokens_over_context", completion(m, "hi", ctx))
        add("big:many_prompts", completion(m, [[11, 12]] * 4000, 1), expect=None,
            note="4000 prompts in one request: a legal fan-out; 200, or a clean 4xx/503")
        add("big:n_max", completion(m, "hi", 1, n=129))
        add("big:stop_ids_many", {**cmp, "stop_token_ids": list(range(100_000))}, expect=(200, 400))
        add("big:stop_strings_many", {**cmp, "stop": ["x"] * 10_000}, expect=(200, 400))
        add("big:messages_many", {"model": m, "max_tokens": 4, "messages": [{"role": "user", "content": "a"}] * 20_000},
            "/v1/chat/completions")
        add("big:header_64k", cmp, headers={**JSON, "x-filler": "a" * 65536}, expect=(200, 400, 413, 431))
        # roles and content
        for role in ("wizard", "", "USER", "function_call"):
            add(f"chat:role_{role or 'empty'}", {**cht, "messages": [{"role": role, "content": "hi"}]},
                "/v1/chat/completions")
        add("chat:role_number", {**cht, "messages": [{"role": 5, "content": "hi"}]}, "/v1/chat/completions")
        add("chat:role_missing", {**cht, "messages": [{"content": "hi"}]}, "/v1/chat/completions")
        add("chat:content_null", {**cht, "messages": [{"role": "user", "content": None}]}, "/v1/chat/completions")
        add("chat:content_missing", {**cht, "messages": [{"role": "user"}]}, "/v1/chat/completions")
        add("chat:content_dict", {**cht, "messages": [{"role": "user", "content": {"text": "hi"}}]},
            "/v1/chat/completions")
        add("chat:content_number", {**cht, "messages": [{"role": "user", "content": 5}]}, "/v1/chat/completions")
        for part in ({"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "bogus"}, {"text": "hi"},
                     {"type": 5, "text": "hi"}, {"type": "text", "text": 5}, {"type": "text"}, "hi", None):
            add("chat:content_part", {**cht, "messages": [{"role": "user", "content": [part]}]},
                "/v1/chat/completions")
        add("chat:messages_empty", {**cht, "messages": []}, "/v1/chat/completions")
        add("chat:messages_missing", {"model": m, "max_tokens": 4}, "/v1/chat/completions")
        add("chat:tokenize_role", {"model": m, "messages": [{"role": "wizard", "content": "hi"}]}, "/tokenize")
        add("chat:tokenize_content_null", {"model": m, "messages": [{"role": "user", "content": None}]}, "/tokenize")
        add("chat:both_generation_flags", {**cht, "add_generation_prompt": True, "continue_final_message": True},
            "/v1/chat/completions")
        add("chat:template_kwargs_reserved", {**cht, "chat_template_kwargs": {"tokenize": True, "messages": 5}},
            "/v1/chat/completions", expect=(200, 400))
        add("chat:top_logprobs_without_logprobs", {**cht, "top_logprobs": 2}, "/v1/chat/completions")
        # stop_token_ids out of range (with min_tokens: the masking path)
        add("stop_ids:negative", {**cmp, "stop_token_ids": [-5]})
        add("stop_ids:negative_min_tokens", {**cmp, "stop_token_ids": [-5], "min_tokens": 2})
        add("stop_ids:vocab_min_tokens", {**cmp, "stop_token_ids": [V], "min_tokens": 2})
        add("stop_ids:huge_min_tokens", {**cmp, "stop_token_ids": [10**9], "min_tokens": 4})
        add("stop_ids:int64_min_tokens", {**cmp, "stop_token_ids": [2**63], "min_tokens": 1})
        add("stop_ids:chat_vocab_min_tokens", {**cht, "stop_token_ids": [V + 7], "min_tokens": 3},
            "/v1/chat/completions")
        add("stop_ids:stream_vocab_min_tokens", {**cmp, "stop_token_ids": [V], "min_tokens": 2, "stream": True})
        add("stop_ids:string", {**cmp, "stop_token_ids": ["1"]}, expect=(200, 400))
        add("min_tokens:over_max", {**cmp, "min_tokens": 5})
        add("min_tokens:negative", {**cmp, "min_tokens": -1})
        # token-id prompts out of vocab
        for ids in ([V], [-1], [2**63], [10**40], [11, V + 100, 12]):
            add("token_ids:out_of_vocab", completion(m, ids, 4))
        add("token_ids:batch_out_of_vocab", completion(m, [[11, 12], [V]], 4))
        add("token_ids:stream_out_of_vocab", completion(m, [V * 2], 4, stream=True))
        # empty prompts
        for p in ("", [], [[]], [""], ["a", ""]):
            add("prompt:empty", completion(m, p, 4))
        add("prompt:tokenize_empty", {"model": m, "prompt": ""}, "/tokenize", expect=(200, 400))
        add("prompt:chat_empty_content", chat(m, "", 2), "/v1/chat/completions", expect=(200, 400))
        # models
        add("model:unknown", {**cmp, "model": "gpt-4"}, expect=(404,))
        add("model:unknown_chat", {**cht, "model": "no-such-model"}, "/v1/chat/completions", expect=(404,))
        add("model:unknown_tokenize", {"model": "nope", "prompt": "hi"}, "/tokenize", expect=(404,))
        add("model:unknown_detokenize", {"model": "nope", "tokens": [1]}, "/detokenize", expect=(404,))
        add("model:unknown_stream", {**cmp, "model": "nope", "stream": True}, expect=(404,))
        add("model:get_unknown", None, "/v1/models/no-such-model", method="GET", expect=(404,))
        add("model:get_traversal", None, "/v1/models/..%2F..%2Fetc%2Fpasswd", method="GET", expect=(404,))
        add("model:get_nul", None, "/v1/models/%00", method="GET", expect=(400, 404))
        add("model:get_surrogate", None, "/v1/models/%ED%A0%80", method="GET", expect=(400, 404))
        add("model:get_long", None, "/v1/models/" + "m" * 20_000, method="GET", expect=(404, 414, 400))
        # methods and paths
        for method, path in (("GET", "/v1/completions"), ("PUT", "/v1/chat/completions"), ("DELETE", "/v1/models"),
                             ("POST", "/v1/models"), ("POST", "/health"), ("PATCH", "/tokenize"),
                             ("GET", "/detokenize"), ("DELETE", "/v1/completions")):
            add(f"method:{method}_{path}", None if method == "GET" else cmp, path, method=method, expect=(405,))
        for path in ("/v1/nope", "/v1/completions/extra", "/v2/completions", "/v1", "/%2e%2e/%2e%2e/etc/passwd",
                     "/v1/chat", "/" + "x" * 10_000):
            add(f"path:{path[:20]}", cmp, path, expect=(404, 405, 414, 400))
        add("method:OPTIONS", None, "/v1/completions", method="OPTIONS", expect=(200, 204, 400, 405))
        add("method:HEAD_health", None, "/health", method="HEAD", expect=(200, 405))
        # content types
        add("ctype:text_plain", cmp, headers={"content-type": "text/plain"}, expect=(200, 400, 415))
        add("ctype:none", cmp, headers={}, expect=(200, 400, 415))
        add("ctype:form", b"model=x&prompt=hi", headers={"content-type": "application/x-www-form-urlencoded"},
            expect=(400, 415))
        add("ctype:multipart", b"--b\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nhi\r\n--b--\r\n",
            headers={"content-type": "multipart/form-data; boundary=b"}, expect=(400, 415))
        add("ctype:utf16_charset", cmp, headers={"content-type": "application/json; charset=utf-16"},
            expect=(200, 400, 415))
        add("ctype:garbage", cmp, headers={"content-type": "foo/bar;;;=;"}, expect=(200, 400, 415))
        add("protocol:control_chars_in_header", cmp, headers={"content-type": "\x01\x02;;;="}, expect=None)
        out[-1].app_level = False
        # JSON syntax
        text = dumps(cmp)
        for cut in (1, len(text) // 2, len(text) - 1):
            add("json:truncated", text[:cut])
        add("json:truncated_chat", dumps(cht)[:-3], "/v1/chat/completions")
        add("json:truncated_tokenize", b'{"prompt": "hi', "/tokenize")
        for body in (b"", b"null", b"[]", b'"str"', b"1e999", b"-", b"{", b"}", b"{,}", b"{'a': 1}", b"true",
                     b'{"a" 1}', b'{"model": "x",}', b"\x00\x00"):
            add("json:not_an_object", body)
        add("json:duplicate_keys", b'{"model": "%s", "prompt": "hi", "max_tokens": 4, "max_tokens": %d}'
            % (m.encode(), 2**64))
        add("json:duplicate_keys_ok", b'{"model": "%s", "prompt": "hi", "max_tokens": 2**70, "max_tokens": 2}'
            % m.encode(), expect=(400,))
        add("json:duplicate_messages", b'{"model": "%s", "max_tokens": 2, "messages": 5, "messages": '
            b'[{"role": "user", "content": "hi"}]}' % m.encode(), "/v1/chat/completions", expect=(200, 400))
        add("json:trailing_garbage", text + b"garbage")
        add("json:two_objects", text + text)
        # unsupported features
        add("unsupported:logit_bias", {**cmp, "logit_bias": {"11": 100}})
        add("unsupported:response_format", {**cht, "response_format": {"type": "json_schema"}}, "/v1/chat/completions")
        add("unsupported:suffix", {**cmp, "suffix": "x"})
        add("unsupported:best_of", {**cmp, "best_of": 3})
        return out

    # ---- random mutations of valid bodies ----
    def mutated(self, rng: random.Random) -> HostileRequest:
        method, path, body = self.valid(rng)
        if body is None:
            return self.mutated_get(rng, path)
        body = copy.deepcopy(body)
        ops = rng.randint(1, 3)
        raw: Optional[bytes] = None
        headers = dict(JSON)
        kinds = []
        for _ in range(ops):
            op = rng.choices(["set", "delete", "extra", "raw_value", "nest", "whole", "bytes", "truncate",
                              "ctype", "method", "message"],
                             weights=[30, 8, 6, 10, 4, 3, 5, 5, 3, 2, 8])[0]
            kinds.append(op)
            if op == "set":
                key = rng.choice(sorted(body) + INT_FIELDS + FLOAT_FIELDS + ["stop", "stop_token_ids", "stream"])
                body[key] = self._hostile_value(rng, key)
            elif op == "delete" and body:
                key = rng.choice(sorted(body))
                if key not in PROTECTED:
                    body.pop(key)
            elif op == "extra":
                body[self._rand_str(rng, 1, 12)] = self._hostile_value(rng, "")
            elif op == "raw_value":
                key = rng.choice(sorted(body) + FLOAT_FIELDS + INT_FIELDS)
                raw = _raw(body, key, rng.choice(NAN_TOKENS + ["1" + "0" * rng.choice([20, 400, 5000]), "1e999",
                                                              "-0", "1E400", "0.0e-999"]))
            elif op == "nest":
                key = rng.choice(sorted(body) or ["x"])
                raw = _raw(body, key, _nested(rng.choice([100, 1000, DEPTH]), rng.choice(["list", "dict"])))
            elif op == "whole":
                raw = rng.choice([b"[]", b"null", b"0", b'"x"', dumps([body]), _nested(DEPTH).encode()])
            elif op == "bytes":
                data = bytearray(raw if raw is not None else dumps(body))
                for _ in range(rng.randint(1, 4)):
                    pos = rng.randrange(len(data) + 1)
                    data[pos:pos] = rng.choice([b"\xff", b"\x80", b"\xed\xa0\x80", b"\x00", b"\\", b'"', b"\\ud800",
                                                b"}", b"[", bytes([rng.randrange(256)])])
                raw = bytes(data)
            elif op == "truncate":
                data = raw if raw is not None else dumps(body)
                raw = data[:rng.randrange(max(1, len(data)))]
            elif op == "ctype":
                headers = rng.choice([{}, {"content-type": "text/plain"}, {"content-type": "application/xml"},
                                      {"content-type": "application/json; charset=latin-1"}])
            elif op == "method":
                method = rng.choice(["GET", "PUT", "DELETE", "PATCH"])
            elif op == "message" and isinstance(body.get("messages"), list) and body["messages"] \
                    and isinstance(body["messages"][0], dict):
                msg = body["messages"][0] = dict(body["messages"][0])
                key = rng.choice(["role", "content", "name", "tool_calls", "tool_call_id"])
                msg[key] = rng.choice([None, "wizard", "", "\ud800", 5, [], [{"type": "bogus"}], {"a": 1},
                                       [{"type": "text", "text": None}], self._rand_str(rng, 0, 40)])
        data = raw if raw is not None else dumps(body)
        return HostileRequest("mutation:" + "+".join(kinds), method, path, data if method != "GET" else None,
                              headers, None)

    def _rand_str(self, rng: random.Random, lo: int, hi: int) -> str:
        # No '.', ':' or digits-with-dots: an echoed value must not look like a leaked path or IP.
        alphabet = "abcdefghijklmnopqrstuvwxyzABCXYZ_- éß中\u0301\U0001F600"
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))

    def _hostile_value(self, rng: random.Random, key: str) -> Any:
        pool = [None, True, False, 0, -1, -5, 1, 3, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30,
                0.5, -0.0, 1e-320, 1e308, -1e308, float("nan"), float("inf"), float("-inf"),
                "", "1", "\ud800", "\udfff", self._rand_str(rng, 1, 30), "x" * rng.choice([100, 10_000]),
                [], [1, 2], [-5], [self.V], ["a", "b"], [[1]], [None], {}, {"a": 1}, {"type": "text"}]
        v = rng.choice(pool)
        if key in PROTECTED and isinstance(v, int) and not isinstance(v, bool) and 4 < v < 2**31:
            v = 4                               # never a valid *long* generation
        if key == "n" and isinstance(v, int) and not isinstance(v, bool) and 4 < v <= 128:
            v = 4
        return v

    def requests(self, n: int) -> list[HostileRequest]:
        """The first `n` of: the catalog (in a seeded order), then seeded random mutations (10% of
        them valid requests, which must succeed: the server keeps serving while it is fuzzed)."""
        rng = random.Random(self.seed)
        cat = self.catalog()
        rng.shuffle(cat)
        out = cat[:n]
        while len(out) < n:
            if rng.random() < 0.1:
                method, path, body = self.valid(rng)
                out.append(HostileRequest("valid", method, path, None if body is None else dumps(body),
                                          dict(JSON) if body is not None else {}, frozenset({200})))
            else:
                out.append(self.mutated(rng))
        return out


# ------------------------------------------------------------------------------------------------
# Fuzz runner
# ------------------------------------------------------------------------------------------------


def _server_failed(reply: Reply) -> bool:
    """No answer, a 5xx, or a 503 that is not "busy, retry" (see OVERLOAD_CODES)."""
    if reply.status is None:
        return True
    if reply.status == 503:
        return not (_retry_after_ok(reply.headers) and _error_code(reply) in OVERLOAD_CODES)
    return reply.status >= 500


def run_requests(base_url: str, model: str, reqs: list[HostileRequest], concurrency: int = 4, timeout: float = 60.0,
                 deadline_s: float = 3600.0, recover_timeout: float = 180.0) -> list[tuple[HostileRequest, Reply, list[str]]]:
    """Send `reqs` (bounded concurrency, overall deadline); returns (request, reply, problems).

    After a server failure (5xx other than 503 + Retry-After, or no response) sending pauses until
    the app serves again (bounded by `recover_timeout`), and that request's problems say how long the
    app was down: a request that kills the engine is named as the cause, and the requests after it
    are not drowned in the 503s of a dead engine."""
    t_end = time.monotonic() + deadline_s
    results: list = [None] * len(reqs)
    gate = threading.Event()
    gate.set()
    recovering = threading.Lock()

    def one(i: int):
        if not gate.wait(recover_timeout + 30) or time.monotonic() > t_end:
            return
        reply = send(base_url, reqs[i], timeout)
        problems = check_reply(reqs[i], reply)
        if _server_failed(reply) and recovering.acquire(blocking=False):
            gate.clear()
            try:
                ok, _ = is_healthy(base_url, model)
                if not ok:
                    try:
                        problems.append(f"the app stopped serving after this request; "
                                        f"serving again after {wait_healthy(base_url, model, recover_timeout):.0f}s")
                    except TimeoutError as e:
                        problems.append(f"the app stopped serving after this request: {e}")
                        results[i] = (reqs[i], reply, problems)
                        raise
            finally:
                gate.set()
                recovering.release()
        results[i] = (reqs[i], reply, problems)

    with cf.ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(one, i) for i in range(len(reqs))]
        for f in futures:
            try:
                f.result()
            except TimeoutError:
                t_end = 0              # the app is gone: stop sending (the remaining ones return at once)
    return [r for r in results if r is not None]


def summarize_fuzz(results, alive: tuple[bool, str], max_examples: int = 40) -> dict:
    statuses: dict[str, int] = {}
    failures = []
    n5xx = leak_count = transport = wrong = shape = 0
    for req, reply, problems in results:
        statuses[str(reply.status)] = statuses.get(str(reply.status), 0) + 1
        if reply.status is None:
            transport += 1
        elif _server_failed(reply):
            n5xx += 1
        if any(p.startswith("leaked") for p in problems):
            leak_count += 1
        if any(p.startswith("status ") for p in problems):
            wrong += 1
        if any(p.startswith(("error body", "error.", "error content", "no x-request-id", "422", "500 whose",
                             "event stream", "unparsable", "error event")) for p in problems):
            shape += 1
        if problems:
            failures.append({"request": req.describe(), "status": reply.status, "problems": problems,
                             "response": (reply.text[:300] if reply.status is not None else reply.transport_error)})
    return {"requests": len(results), "statuses": statuses, "server_errors": n5xx, "leaks": leak_count,
            "transport_errors": transport, "wrong_status": wrong, "bad_shape": shape,
            "failed_requests": len(failures), "alive_after": alive[0], "alive_detail": alive[1],
            "failures": failures[:max_examples]}


def run_fuzz(base_url: str, model: str, vocab_size: int, max_model_len: int, n: int, seed: int = 0,
             concurrency: int = 4, timeout: float = 60.0, deadline_s: float = 3600.0) -> dict:
    reqs = HostileGenerator(seed, model, vocab_size, max_model_len).requests(n)
    t0 = time.monotonic()
    results = run_requests(base_url, model, reqs, concurrency, timeout, deadline_s)
    out = summarize_fuzz(results, is_healthy(base_url, model))
    out.update(seed=seed, planned=n, seconds=round(time.monotonic() - t0, 1))
    return out


