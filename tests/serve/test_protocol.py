"""Offline tests of the OpenAI protocol layer: parsing, conversion to SamplingParams, logprob
formatting, token strings, error mapping. No Ray cluster, no server."""
import json
import pickle

import pytest

from glm_ray.engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from glm_ray.engine.sampling_params import SamplingParams
from glm_ray.serve import logprobs as L
from glm_ray.serve import protocol as P
from glm_ray.serve import responses as R
from glm_ray.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    check_prompt_fits,
    check_token_ids,
    parse_body,
    parse_tokenize_body,
    to_sampling_params,
)


def completion(**kw):
    kw.setdefault("prompt", "hi")
    return parse_body(json.dumps(kw), CompletionRequest)


def chat(**kw):
    kw.setdefault("messages", [{"role": "user", "content": "hi"}])
    return parse_body(json.dumps(kw), ChatCompletionRequest)


def api_error(fn, *a, **kw) -> APIError:
    with pytest.raises(APIError) as ei:
        fn(*a, **kw)
    return ei.value


# ------------------------------------------------------------------ parsing


def test_malformed_json_is_400_invalid_json():
    e = api_error(parse_body, b'{"prompt": "x",', CompletionRequest)
    assert e.status_code == 400 and e.code == "invalid_json"
    body = e.to_dict()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("body", [b"", b"[1, 2]", b'"text"', b"null", b"\xff\xfe"])
def test_non_object_body_is_400(body):
    assert api_error(parse_body, body, CompletionRequest).status_code == 400


def test_missing_required_field_names_param():
    e = api_error(parse_body, b'{"model": "m"}', CompletionRequest)
    assert e.status_code == 400 and e.param == "prompt"
    e = api_error(parse_body, b'{"messages": []}', ChatCompletionRequest)
    assert e.param == "messages"


def test_wrong_type_names_param():
    e = api_error(completion, temperature="hot")
    assert e.param == "temperature"
    e = api_error(chat, n="two")
    assert e.param == "n"


def test_unknown_fields_are_ignored():
    r = completion(frobnicate=3, guided_json={"a": 1})
    assert r.ignored_fields() == ["frobnicate", "guided_json"]
    sp = to_sampling_params(r, default_max_tokens=100)
    assert isinstance(sp, SamplingParams)


@pytest.mark.parametrize("prompt,expected", [
    ("hello", ["hello"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_prompt_forms(prompt, expected):
    assert completion(prompt=prompt).prompt_list() == expected


@pytest.mark.parametrize("prompt", ["", [], [""], [[]], [[1], []]])
def test_empty_prompt_is_400(prompt):
    e = api_error(lambda: completion(prompt=prompt).prompt_list())
    assert e.param == "prompt"


def test_mixed_prompt_list_is_400():
    assert api_error(completion, prompt=[1, "a"]).param == "prompt"


def test_chat_content_parts_are_flattened():
    r = chat(messages=[
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {
            "name": "f", "arguments": '{"x": [1]}'}}]},
        {"role": "user", "content": "plain", "name": "bob"},
    ])
    msgs = r.template_messages()
    assert msgs[0] == {"role": "system", "content": "be brief"}
    assert msgs[1]["content"] == "a\nb"
    assert msgs[2]["content"] == "" and msgs[2]["tool_calls"] == [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": {"x": [1]}}}]
    assert msgs[3] == {"role": "user", "content": "plain", "name": "bob"}


def test_assistant_tool_calls_need_a_function_with_object_arguments():
    def turn(*calls):
        return chat(messages=[{"role": "user", "content": "a"},
                              {"role": "assistant", "content": None, "tool_calls": list(calls)}]).template_messages()

    assert api_error(turn, {"id": "1"}).param == "messages"                              # no function
    assert api_error(turn, {"function": {"arguments": "{}"}}).param == "messages"        # no name
    for bad in ("[1, 2]", "not json", '"x"'):
        e = api_error(turn, {"function": {"name": "f", "arguments": bad}})
        assert e.status_code == 400 and "tool_calls[0].function.arguments" in e.message
    assert turn({"function": {"name": "f"}})[1]["tool_calls"][0]["function"]["arguments"] == {}
    assert turn({"function": {"name": "f", "arguments": {"k": 1}}})[1]["tool_calls"][0]["function"] == {
        "name": "f", "arguments": {"k": 1}}


def test_chat_image_part_is_400():
    e = api_error(chat, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert e.status_code == 400 and e.param == "messages" and "'text'" in e.message


def test_tokenize_body_dispatch():
    assert isinstance(parse_tokenize_body(b'{"prompt": "x"}'), TokenizeCompletionRequest)
    r = parse_tokenize_body(b'{"messages": [{"role": "user", "content": "x"}]}')
    assert isinstance(r, TokenizeChatRequest) and r.add_generation_prompt and not r.add_special_tokens
    assert api_error(parse_tokenize_body, b"{oops").status_code == 400
    assert parse_body(b'{"tokens": [1, 2]}', DetokenizeRequest).tokens == [1, 2]
    assert api_error(parse_body, b'{"tokens": ["a"]}', DetokenizeRequest).param == "tokens"


def test_stream_options():
    r = completion(stream=True, stream_options={"include_usage": True})
    assert r.include_usage and not r.continuous_usage
    assert not completion(stream=True).include_usage
    assert not completion(stream=True, stream_options=None).include_usage


# ------------------------------------------------------------------ SamplingParams conversion


def test_completion_defaults():
    sp = to_sampling_params(completion(), default_max_tokens=1000)
    assert sp.max_tokens == 16          # OpenAI/vLLM completions default
    assert sp.n == 1 and sp.temperature == 1.0 and sp.top_p == 1.0 and sp.top_k == -1
    assert sp.logprobs is None and sp.prompt_logprobs is None and sp.stop == []
    assert sp.skip_special_tokens is True and sp.ignore_eos is False


def test_chat_max_tokens_defaults_to_fill_context():
    assert to_sampling_params(chat(), default_max_tokens=77).max_tokens == 77
    assert to_sampling_params(chat(max_tokens=5), default_max_tokens=77).max_tokens == 5
    # max_completion_tokens wins over the deprecated max_tokens
    assert to_sampling_params(chat(max_tokens=5, max_completion_tokens=9), 77).max_tokens == 9
    assert to_sampling_params(completion(max_tokens=None), default_max_tokens=33).max_tokens == 33


def test_all_sampling_fields_pass_through():
    sp = to_sampling_params(completion(
        n=3, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=7, max_tokens=20, min_tokens=2,
        stop="END", stop_token_ids=[5, 6], ignore_eos=True, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.1, prompt_logprobs=2,
        include_stop_str_in_output=True, skip_special_tokens=False, logprobs=3, user="u"), 100)
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.seed) == (3, 0.5, 0.9, 40, 0.05, 7)
    assert (sp.max_tokens, sp.min_tokens, sp.stop, sp.stop_token_ids) == (20, 2, ["END"], [5, 6])
    assert sp.ignore_eos and sp.include_stop_str_in_output and not sp.skip_special_tokens
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -0.5, 1.1)
    assert sp.logprobs == 3 and sp.prompt_logprobs == 2


def test_stop_list_and_top_k_zero():
    sp = to_sampling_params(completion(stop=["a", "bb"], top_k=0), 10)
    assert sp.stop == ["a", "bb"] and sp.top_k == -1


def test_greedy():
    assert to_sampling_params(chat(temperature=0), 10).greedy


@pytest.mark.parametrize("field,value,param", [
    ("max_tokens", -1, "max_tokens"),
    ("max_tokens", 0, "max_tokens"),
    ("temperature", -0.1, "temperature"),
    ("top_p", 0.0, "top_p"),
    ("top_p", 1.5, "top_p"),
    ("top_k", -2, "top_k"),
    ("min_p", 2.0, "min_p"),
    ("n", 0, "n"),
    ("presence_penalty", 3.0, "presence_penalty"),
    ("frequency_penalty", -3.0, "frequency_penalty"),
    ("repetition_penalty", 0.0, "repetition_penalty"),
    ("min_tokens", -1, "min_tokens"),
    ("logprobs", 21, "logprobs"),
    ("logprobs", -1, "logprobs"),
    ("prompt_logprobs", 99, "prompt_logprobs"),
    ("stop", [""], "stop"),
])
def test_invalid_completion_params_are_400_with_param(field, value, param):
    e = api_error(lambda: to_sampling_params(completion(**{field: value}), 100))
    assert e.status_code == 400 and e.param == param, e
    # the offline API applies the same rule (one rule set: sampling_params.BOUNDS)
    with pytest.raises(ValueError) as ei:
        SamplingParams(**{field: value})
    assert getattr(ei.value, "param", None) == param


def test_min_tokens_above_max_tokens():
    assert api_error(to_sampling_params, completion(min_tokens=5, max_tokens=2), 100).param == "min_tokens"


def test_n_limit():
    assert api_error(lambda: to_sampling_params(completion(n=P.MAX_N + 1), 100)).param == "n"


def test_chat_max_completion_tokens_param_name():
    e = api_error(lambda: to_sampling_params(chat(max_completion_tokens=-3), 100))
    assert e.param == "max_completion_tokens"
    assert api_error(lambda: to_sampling_params(chat(max_tokens=-3), 100)).param == "max_tokens"


def test_chat_logprobs_mapping():
    assert to_sampling_params(chat(), 10).logprobs is None
    assert to_sampling_params(chat(logprobs=False), 10).logprobs is None
    assert to_sampling_params(chat(logprobs=True), 10).logprobs == 0
    assert to_sampling_params(chat(logprobs=True, top_logprobs=5), 10).logprobs == 5
    assert api_error(to_sampling_params, chat(top_logprobs=2), 10).param == "top_logprobs"
    assert api_error(lambda: to_sampling_params(chat(logprobs=True, top_logprobs=21), 10)).param == "top_logprobs"
    assert api_error(lambda: to_sampling_params(chat(logprobs=True, top_logprobs=-1), 10)).param == "top_logprobs"


def test_echo_with_logprobs_requests_prompt_logprobs():
    assert to_sampling_params(completion(echo=True, logprobs=2), 10).prompt_logprobs == 2
    assert to_sampling_params(completion(echo=True, logprobs=2, prompt_logprobs=4), 10).prompt_logprobs == 4
    assert to_sampling_params(completion(echo=True), 10).prompt_logprobs is None
    assert to_sampling_params(completion(logprobs=2), 10).prompt_logprobs is None


def test_unsupported_features_are_rejected_not_ignored():
    assert api_error(lambda: to_sampling_params(completion(logit_bias={"5": 10}), 10)).param == "logit_bias"
    assert api_error(lambda: to_sampling_params(completion(suffix="x"), 10)).param == "suffix"
    assert api_error(to_sampling_params, completion(best_of=3), 10).param == "best_of"
    e = api_error(lambda: to_sampling_params(chat(response_format={"type": "xml"}), 10))
    assert e.param == "response_format"
    # harmless values pass
    to_sampling_params(completion(logit_bias={}, best_of=1, suffix=""), 10)
    to_sampling_params(chat(response_format={"type": "text"}, logit_bias=None), 10)


def test_nulls_mean_defaults():
    r = chat(temperature=None, top_p=None, n=None, stop=None, stop_token_ids=None, min_tokens=None,
             skip_special_tokens=None, presence_penalty=None, seed=None, user=None)
    sp = to_sampling_params(r, 10)
    assert sp.temperature == 1.0 and sp.n == 1 and sp.stop == [] and sp.skip_special_tokens


def test_generation_config_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [1, 2], "do_sample": True}))
    d = P.load_generation_defaults(str(tmp_path))
    assert d == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    sp = to_sampling_params(chat(), 10, defaults=d)
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.6, 0.95, 20)
    sp = to_sampling_params(chat(temperature=0, top_p=1.0, top_k=-1), 10, defaults=d)
    assert (sp.temperature, sp.top_p, sp.top_k) == (0, 1.0, -1)
    assert P.load_generation_defaults(str(tmp_path / "missing")) == {}


# ------------------------------------------------------------------ context length


def test_check_prompt_fits():
    check_prompt_fits(10, 90, 100)
    check_prompt_fits(99, None, 100)
    e = api_error(check_prompt_fits, 10, 91, 100)
    assert e.status_code == 400 and e.code == "context_length_exceeded" and e.param == "max_tokens"
    assert "100" in e.message and "101" in e.message
    e = api_error(check_prompt_fits, 100, None, 100, "messages")
    assert e.param == "messages" and e.code == "context_length_exceeded"
    assert api_error(check_prompt_fits, 150, 1, 100).param == "prompt"


def test_check_token_ids():
    check_token_ids([0, 5, 9], 10)
    assert api_error(check_token_ids, [3, 10], 10).param == "prompt"
    assert api_error(check_token_ids, [-1], 10, "tokens").param == "tokens"


# ------------------------------------------------------------------ logprob formatting


class FakeTok:
    """token id -> 't<id>' (id 9 is a partial UTF-8 byte)."""

    def text(self, t):
        return "\ufffd" if t == 9 else f"t{t}"

    def bytes(self, t):
        return b"\xe4" if t == 9 else f"t{t}".encode()


def test_completion_logprobs_shapes_and_offsets():
    ids = [3, 1, 2]
    lps = [{3: -0.5, 1: -1.0, 2: -2.0},                  # sampled is the top-1
           {1: -3.0, 4: -0.1, 5: -0.2},                  # sampled outside top-2: k+1 entries
           {2: -float("inf"), 6: -0.01}]                 # -inf must become JSON-safe
    out = L.completion_logprobs(ids, lps, 2, FakeTok(), initial_offset=7)
    assert out.tokens == ["t3", "t1", "t2"]
    assert out.text_offset == [7, 9, 11]
    assert out.token_logprobs == [-0.5, -3.0, P.MIN_LOGPROB]
    assert list(out.top_logprobs[0]) == ["t3", "t1"]
    assert out.top_logprobs[1] == {"t4": -0.1, "t5": -0.2, "t1": -3.0}
    assert out.top_logprobs[2] == {"t6": -0.01, "t2": P.MIN_LOGPROB}
    json.dumps(out.model_dump(), allow_nan=False)


def test_completion_logprobs_k0_and_missing_positions():
    out = L.completion_logprobs([3, 4], [None, {4: -0.3, 7: -0.1}], 0, FakeTok())
    assert out.token_logprobs == [None, -0.3]
    assert out.top_logprobs == [None, {"t4": -0.3}]
    assert out.text_offset == [0, 2]


def test_completion_logprobs_extend():
    a = L.completion_logprobs([1], [{1: -1.0}], 1, FakeTok())
    a.extend(L.completion_logprobs([2], [{2: -2.0}], 1, FakeTok(), initial_offset=2))
    assert a.tokens == ["t1", "t2"] and a.text_offset == [0, 2] and len(a.top_logprobs) == 2


def test_chat_logprobs():
    entries = L.chat_logprobs([9, 2], [{9: -0.2, 2: -1.5, 3: -0.9}, {2: -0.7, 1: -0.1}], 2, FakeTok())
    e0, e1 = entries
    assert e0.token == "\ufffd" and e0.bytes == [0xE4] and e0.logprob == -0.2
    assert [t.token for t in e0.top_logprobs] == ["\ufffd", "t3"]
    assert [t.logprob for t in e0.top_logprobs] == [-0.2, -0.9]
    assert len(e1.top_logprobs) == 2 and e1.top_logprobs[0].token == "t1"
    # top_logprobs=0 -> only the sampled token, no alternatives
    assert L.chat_logprobs([2], [{2: -0.7, 1: -0.1}], 0, FakeTok())[0].top_logprobs == []
    d = R.ChatChoiceLogprobs(content=entries).model_dump()
    assert set(d["content"][0]) == {"token", "logprob", "bytes", "top_logprobs"}


def test_top_items_order_and_ties():
    assert L.top_items({1: -1.0, 2: -0.5, 3: -0.5}, 2) == [(2, -0.5), (3, -0.5)]
    assert L.top_items({1: -1.0}, 0) == []


def test_prompt_logprobs_format():
    out = L.format_prompt_logprobs([5, 6, 7], [None, {6: -0.2, 8: -0.1}, {7: -4.0, 1: -0.1}], 1, FakeTok())
    assert out[0] is None
    assert out[1][8].rank == 1 and out[1][6].rank is None and out[1][6].logprob == -0.2
    assert out[2][1].decoded_token == "t1" and 7 in out[2]
    assert L.format_prompt_logprobs([1], None, 1, FakeTok()) is None
    # serializes with string keys
    assert json.loads(json.dumps(R.CompletionResponseChoice(index=0, text="", prompt_logprobs=out).model_dump()))


def test_clamp_logprob():
    assert L.clamp_logprob(float("nan")) == P.MIN_LOGPROB
    assert L.clamp_logprob(-1e30) == P.MIN_LOGPROB
    assert L.clamp_logprob(None) is None
    assert L.clamp_logprob(-0.25) == -0.25


# ------------------------------------------------------------------ response shapes


def test_sse_framing_and_delta():
    chunk = R.ChatCompletionStreamResponse(
        id="x", model="m", choices=[R.ChatCompletionStreamChoice(index=0, delta=R.DeltaMessage(content="hi"))])
    frame = R.sse(chunk)
    assert frame.startswith("data: ") and frame.endswith("\n\n")
    d = json.loads(frame[6:])
    assert d["object"] == "chat.completion.chunk"
    assert d["choices"][0]["delta"] == {"content": "hi"}        # no "role": null
    assert d["choices"][0]["finish_reason"] is None and "usage" in d
    assert R.SSE_DONE == "data: [DONE]\n\n"
    role = R.DeltaMessage(role="assistant", content="").model_dump()
    assert role == {"role": "assistant", "content": ""}


def test_usage_and_response_shapes():
    u = R.UsageInfo.of(5, 7, cached_tokens=2)
    assert u.total_tokens == 12 and u.prompt_tokens_details.cached_tokens == 2
    r = R.CompletionResponse(id="cmpl-1", model="m", usage=u,
                             choices=[R.CompletionResponseChoice(index=0, text="x", finish_reason="length")])
    d = r.model_dump()
    assert d["object"] == "text_completion" and isinstance(d["created"], int)
    c = R.ChatCompletionResponse(id="c", model="m", usage=u, choices=[R.ChatCompletionResponseChoice(
        index=0, message=R.ChatResponseMessage(content="x"), finish_reason="stop")]).model_dump()
    assert c["object"] == "chat.completion" and c["choices"][0]["message"]["role"] == "assistant"
    m = R.ModelList(data=[R.ModelCard(id="m", max_model_len=8)]).model_dump()
    assert m["object"] == "list" and m["data"][0]["object"] == "model"
    t = R.TokenizeResponse(count=2, max_model_len=8, tokens=[1, 2]).model_dump()
    assert t == {"count": 2, "max_model_len": 8, "tokens": [1, 2], "token_strs": None}


def test_random_ids_are_unique():
    assert R.random_id("cmpl") != R.random_id("cmpl")
    assert R.random_id("chatcmpl").startswith("chatcmpl-")


def test_format_validation_errors():
    msg, param = P.format_validation_errors([{"loc": ("body", "messages", 0, "role"), "msg": "Field required"}])
    assert param == "messages" and "messages.0.role" in msg
    msg, param = P.format_validation_errors([])
    assert param is None and msg


# ------------------------------------------------------------------ token strings (real tokenizer)


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|user|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, hello there. 你好世界 " * 20], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    path = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(str(path))
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))


def test_token_strings_byte_level(bpe_tokenizer):
    from glm_ray.serve.detok import TokenStrings

    ts = TokenStrings(bpe_tokenizer)
    assert ts.byte_level
    text = "hello wörld 你好 <|user|>"
    ids = bpe_tokenizer.encode(text, add_special_tokens=False)
    # the bytes of the tokens concatenate to the exact UTF-8 text, even across split characters
    assert b"".join(ts.bytes(i) for i in ids).decode("utf-8") == text
    assert ts.text(bpe_tokenizer.convert_tokens_to_ids("<|user|>")) == "<|user|>"
    for i in ids:
        assert isinstance(ts.text(i), str) and ts.text(i)
    assert ts.texts(ids[:2]) == [ts.text(ids[0]), ts.text(ids[1])]


# ------------------------------------------------------------------ engine error mapping (no cluster)


def test_engine_errors_survive_pickling():
    e = pickle.loads(pickle.dumps(EngineOverloadedError("busy", retry_after_s=7.5)))
    assert e.retry_after_s == 7.5 and e.message == "busy"
    e = pickle.loads(pickle.dumps(InvalidRequestError("bad", param="stop")))
    assert e.param == "stop"


def test_map_exception_unwraps_ray_errors():
    ingress = pytest.importorskip("glm_ray.serve.errors")
    from ray.exceptions import RayTaskError

    def wrap(cause):
        try:
            raise cause
        except Exception as c:  # noqa: BLE001
            return RayTaskError("generate", "Traceback...\n" + repr(c), c).as_instanceof_cause()

    a = ingress.map_exception(wrap(InvalidRequestError("prompt too long", param="prompt")))
    assert (a.status_code, a.param, a.message) == (400, "prompt", "prompt too long")
    a = ingress.map_exception(wrap(EngineOverloadedError("queue full", retry_after_s=2.2)))
    assert a.status_code == 503 and a.headers["Retry-After"] == "3"
    a = ingress.map_exception(wrap(EngineDeadError("worker died")))
    assert a.status_code == 503
    # chained (raise ... from ...)
    try:
        try:
            raise EngineOverloadedError("busy")
        except EngineOverloadedError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert ingress.map_exception(outer).status_code == 503
    a = ingress.map_exception(ValueError("weird"))
    assert a.status_code == 500 and a.to_dict()["error"]["type"] == "internal_error"
    assert ingress.map_exception(P.bad_request("x", param="n")).param == "n"
