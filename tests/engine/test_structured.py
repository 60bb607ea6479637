"""Structured outputs (engine/structured.py, the sampler's bitmask, serve/tool_grammar.py).

Oracles: the allowed tokens of a `choice` grammar are computed from the tokenizer's own decoding (a token
is allowed iff the text so far plus its text is a prefix of a choice); the bitmask's effect on logits is
checked bit by bit in Python; outputs of the tiny model are parsed with `json` and validated with
`jsonschema`; tool calls are parsed with a regex and their arguments validated with `jsonschema`; the
GLM tool-call grammar is compared with xgrammar's own GLM builder. Greedy and seeded outputs are the
same through preemption and async scheduling (the engine's batch invariance makes that exact)."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from glm_ray import LLM, SamplingParams
from glm_ray.config import ModelConfig
from glm_ray.engine.sampling_params import StructuredOutputsParams as SO
from glm_ray.engine.structured import GrammarRuntime, TokenBitmask, apply_token_bitmask, check, tokenizer_info
from glm_ray.engine.tokenizer import load_tokenizer
from glm_ray.serve.tool_grammar import MAX_WHITESPACE, glm_tool_call_format, glm_tool_call_structured_outputs
from glm_ray.worker.cache import kv_bytes_per_token
from glm_ray.worker.sampler import SamplingRow, sample

PERSON = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
                         "ok": {"type": "boolean"}},
          "required": ["name", "age", "color", "tags", "ok"]}
CHOICES = ["yes", "no", "maybe"]


@pytest.fixture(scope="module")
def tok(oracle_dir):
    return load_tokenizer(oracle_dir)


@pytest.fixture(scope="module")
def model_cfg(oracle_dir):
    return ModelConfig.from_pretrained(oracle_dir, "float32")


@pytest.fixture
def runtime(tok, model_cfg):
    V, eos = model_cfg.vocab_size, model_cfg.eos_token_ids
    return GrammarRuntime(lambda: tokenizer_info(tok, V, eos), V, eos, threads=2)


def _bits(bitmask: torch.Tensor, V: int) -> list[set[int]]:
    """Oracle unpacking: the allowed token ids of each row, bit by bit."""
    out = []
    for row in bitmask.tolist():
        out.append({v for v in range(V) if (row[v // 32] >> (v % 32)) & 1})
    return out


def _choice_oracle(tok, V: int, prefix: str, eos) -> set[int]:
    """Tokens whose text extends `prefix` towards one of CHOICES; only the stop ids once it is complete."""
    special = set(tok.all_special_ids)
    allowed = set()
    for t in range(min(V, len(tok))):
        s = tok.decode([t])
        if t not in special and s and any(c.startswith(prefix + s) for c in CHOICES):
            allowed.add(t)
    return allowed or (set(eos) if prefix in CHOICES else set())


# ---- the bitmask ---------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [None, [4, 1, 2]])
def test_apply_token_bitmask_sets_exactly_the_zero_bits_to_minus_inf(rows):
    g = torch.Generator().manual_seed(0)
    N, V = 5, 100                                      # V not a multiple of 32
    logits = torch.randn(N, V, generator=g)
    K = N if rows is None else len(rows)
    bits = torch.randint(-2**31, 2**31 - 1, (K, 4), generator=g, dtype=torch.int64).to(torch.int32)
    bits[1] = -1                                       # a row with everything allowed
    out = apply_token_bitmask(logits, TokenBitmask(bits, None if rows is None else torch.tensor(rows)))
    allowed = dict(zip(range(N) if rows is None else rows, _bits(bits, V)))
    for n in range(N):
        for v in range(V):
            if n not in allowed or v in allowed[n]:
                assert out[n, v] == logits[n, v]
            else:
                assert out[n, v] == float("-inf")
    assert any(len(a) < V / 2 + 20 for a in allowed.values())


def test_batched_bitmask_mixes_constrained_and_free_rows(runtime, tok, model_cfg):
    """Rows: a fresh choice grammar, a free row, the same grammar after "ma", one after a complete
    "no" (only stop ids), and a JSON row; each constrained row equals the tokenizer oracle."""
    V, eos = model_cfg.vocab_size, model_cfg.eos_token_ids
    sp = SamplingParams(structured_outputs=SO(choice=CHOICES))
    gs = [runtime.start(sp), None, runtime.start(sp), runtime.start(sp)]
    hist = [[], [], tok.encode("ma", add_special_tokens=False), tok.encode("no", add_special_tokens=False)]
    mask = runtime.bitmask(gs, hist, torch.device("cpu"))
    assert mask.bits.shape == (3, (V + 31) // 32) and mask.bits.dtype == torch.int32
    assert mask.rows.tolist() == [0, 2, 3]                               # the free row has no mask
    c0, c2, c3 = _bits(mask.bits, V)
    rows = [c0, set(range(V)), c2, c3]
    assert rows[0] == _choice_oracle(tok, V, "", eos) and {tok.encode("y", add_special_tokens=False)[0]} <= rows[0]
    assert rows[2] == _choice_oracle(tok, V, "ma", eos)
    assert rows[3] == set(eos)
    assert runtime.bitmask([None, None], [[], []], torch.device("cpu")) is None
    # tokens outside the grammar get -inf in the sampler, and every row samples an allowed token
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, V, generator=g) * 3
    srows = [SamplingRow(SamplingParams(temperature=t, seed=s), torch.Generator().manual_seed(s), [1], h, eos)
             for t, s, h in zip((0.0, 1.0, 0.7, 1.0), (1, 2, 3, 4), hist)]
    toks, raw = sample(logits, srows, mask)
    for n, t in enumerate(toks.tolist()):
        assert t in rows[n]
    assert toks[0] == max(rows[0], key=lambda v: logits[0, v])             # greedy = argmax over the allowed
    assert torch.allclose(raw, torch.log_softmax(logits, -1))            # logprobs stay the model's
    free = [SamplingRow(r.params, torch.Generator().manual_seed(s), [1], r.output_ids, eos)
            for r, s in zip(srows, (1, 2, 3, 4))]
    assert sample(logits, free)[0][1] == toks[1]                         # the free row is untouched


def test_format_after_a_reasoning_block(runtime, tok, model_cfg):
    """`reasoning_end`: free text until the marker, then up to two spaces/newlines, then the format."""
    V = model_cfg.vocab_size
    sp = SamplingParams(structured_outputs=SO(choice=CHOICES, reasoning_end="</think>"))
    thinking = tok.encode('Let me think: {"a": 1} maybe', add_special_tokens=False)
    done = tok.encode("Let me think</think>", add_special_tokens=False)
    before, after = _bits(runtime.bitmask([runtime.start(sp), runtime.start(sp)], [thinking, done],
                                          torch.device("cpu")).bits, V)
    assert len(before) > V // 2                                           # thinking: (nearly) anything
    special = set(tok.all_special_ids)

    def oracle(t: int) -> bool:                                          # [ \n]{0,2} then a choice's prefix
        s = tok.decode([t])
        rest = s.lstrip(" \n")
        ws = len(s) - len(rest)
        return (t not in special and bool(s) and ws <= 2
                and (rest == "" or any(c.startswith(rest) for c in CHOICES)))
    assert after == {t for t in range(min(V, len(tok))) if oracle(t)}
    check(SO(json=PERSON, reasoning_end="</think>"))
    assert SO(json=PERSON, reasoning_end="</think>").key != SO(json=PERSON).key


def test_length_limited_json_strings_admit_no_control_characters(runtime, tok, model_cfg):
    """xgrammar 0.2.9 lets raw control characters into strings with maxLength (json.loads rejects
    them); structured.py narrows the character class."""
    V = model_cfg.vocab_size
    g = runtime.start(SamplingParams(structured_outputs=SO(json=PERSON)))
    mask = runtime.bitmask([g], [tok.encode('{"name": "a', add_special_tokens=False)], torch.device("cpu"))
    allowed = _bits(mask.bits, V)[0]
    assert allowed
    for t in allowed:
        s = tok.decode([t])
        assert not any(ord(c) < 0x20 for c in s), (t, s)


@pytest.mark.parametrize("spec,prefix", [
    (SO(json=PERSON), b'{"name": "'),                                 # a length-limited string
    (SO(json={"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}), b'{"s": "'),
    (SO(structural_tag=json.dumps(glm_tool_call_format(
        {"f": {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}}}}, ("f",), "named"))),
     b"<tool_call>f<arg_key>s</arg_key><arg_value>"),              # a raw tool-call argument
])
def test_strings_take_only_valid_utf8(runtime, spec, prefix):
    """xgrammar 0.2.9 takes encoded UTF-16 surrogates as characters (Python decodes them to three U+FFFD,
    past a maxLength); the sanitized grammars refuse them and take real 3- and 4-byte characters."""
    cg = runtime.compile(spec)
    for tail, ok in ((b"\xed\xa0\x80", False), (b"\xed\xbf\xbf", False), (b"\xe2\x82\xac", True),
                     (b"\xf0\x9f\x98\x80", True), (b"a", True)):
        m = xgr.GrammarMatcher(cg)
        assert m.accept_string(prefix) and m.accept_string(tail) == ok, (prefix, tail)


def test_history_rollback_equals_a_fresh_matcher(runtime, tok, model_cfg):
    """The matcher follows the output history: after a longer history is cut back (preemption dropping
    tokens, a rejected draft) or replaced, its mask is the mask of a fresh matcher fed the new history."""
    sp = SamplingParams(structured_outputs=SO(json=PERSON))
    text = '{"name": "bob", "age": 41, "color": "green", "tags": ["x"], "ok": true}'
    ids = tok.encode(text, add_special_tokens=False)
    g = runtime.start(sp)
    dev = torch.device("cpu")

    def bits(grammar, history):
        return runtime.bitmask([grammar], [history], dev).bits.clone()
    full = bits(g, ids)
    assert _bits(full, model_cfg.vocab_size)[0] == set(model_cfg.eos_token_ids)   # complete: stop only
    for cut in (len(ids) - 1, 7, 1, 0):
        assert torch.equal(bits(g, ids[:cut]), bits(runtime.start(sp), ids[:cut])), cut
    other = tok.encode('{"name": "al', add_special_tokens=False)
    assert torch.equal(bits(g, other), bits(runtime.start(sp), other))      # other tokens, same prefix start
    assert g.num_rollbacks > 0
    assert torch.equal(bits(g, ids), full)                                  # and forward again
    with pytest.raises(ValueError, match="does not match"):
        runtime.bitmask([g, None], [tok.encode('{"nope', add_special_tokens=False), []], dev)


def test_compiled_grammars_are_cached(runtime):
    a, b = SO(json=PERSON), SO(json=json.dumps(PERSON, ensure_ascii=False))   # the same schema, dict and text
    ca = runtime.compile(a)
    assert runtime.compile(b) is ca and runtime.num_compiles == 1 and runtime.num_cache_hits == 1
    runtime.compile(SO(regex="[a-z]+"))
    assert runtime.num_compiles == 2
    sp = SamplingParams(structured_outputs=SO(json=PERSON))
    runtime.start(sp).matcher                                              # through the compile thread
    assert runtime.num_compiles == 2 and runtime.num_cache_hits == 2
    runtime.cache_limit = 1                                                # now only the newest stays
    runtime.compile(SO(regex="[0-9]+"))
    runtime.compile(a)
    assert runtime.num_compiles == 4


@pytest.mark.parametrize("spec,param,match", [
    (SO(json={"type": "frobnicate"}), "response_format", "cannot be enforced"),
    (SO(json="{not json"), "response_format", "not valid JSON"),
    (SO(json="[1, 2]"), "response_format", "must be an object"),
    (SO(regex="(unclosed"), "response_format", "cannot be enforced"),
    (SO(grammar="root ::= "), "response_format", "cannot be enforced"),
    (SO(structural_tag='{"type": "structural_tag", "format": {"type": "nope"}}'), "tools", "cannot be enforced"),
    (SO(json=PERSON, regex="a"), "structured_outputs", "exactly one"),
    (SO(), "structured_outputs", "exactly one"),
])
def test_bad_specs_are_rejected_before_compiling(spec, param, match):
    with pytest.raises(ValueError, match=match) as ei:
        check(spec)
    assert ei.value.param == param


def test_sampling_params_shape_rules():
    with pytest.raises(ValueError, match="min_tokens") as ei:
        SamplingParams(min_tokens=2, structured_outputs=SO(json_object=True))
    assert ei.value.param == "min_tokens"
    with pytest.raises(ValueError, match="non-empty list"):
        SamplingParams(structured_outputs=SO(choice=[]))
    check(SO(choice=['a "quoted" one', "back\\slash", "ünï"]))           # JSON-escaped EBNF literals
    assert SO(json=PERSON).key == SO(json=json.dumps(PERSON, ensure_ascii=False)).key


# ---- through the engine --------------------------------------------------------------------------
def _prompts(n):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(10, 1000, (int(k),), generator=g).tolist() for k in torch.randint(3, 40, (n,), generator=g)]


def _params():
    out = []
    for i in range(8):
        out.append(SamplingParams(max_tokens=200, temperature=0 if i % 2 else 1.0, seed=i,
                                  structured_outputs=SO(json=PERSON)))
    out += [SamplingParams(max_tokens=30, temperature=0.8, seed=40, structured_outputs=SO(regex=r"[a-f]{2,6}-[0-9]{1,3}")),
            SamplingParams(max_tokens=30, temperature=1.0, seed=41, structured_outputs=SO(choice=CHOICES)),
            SamplingParams(max_tokens=24, temperature=1.0, seed=42, ignore_eos=True),          # unconstrained
            SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)]
    return out


def _gen(path, **kw):
    kw.setdefault("kv_cache_memory_bytes", 32 << 20)
    llm = LLM(path, dtype="float32", **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts(12)], _params(), use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outs], llm


def test_outputs_match_their_grammar_through_preemption_and_async_scheduling(oracle_dir):
    ref, _ = _gen(oracle_dir)
    for ids, finish, text in ref[:8]:
        assert finish == "stop", text                       # a bounded schema ends well within max_tokens
        jsonschema.validate(json.loads(text), PERSON)
    assert ref[8][1] == "stop" and re.fullmatch(r"[a-f]{2,6}-[0-9]{1,3}", ref[8][2])
    assert ref[9][1] == "stop" and ref[9][2] in CHOICES
    assert ref[10][1] == ref[11][1] == "length"
    per_tok = kv_bytes_per_token(ModelConfig.from_pretrained(oracle_dir, "float32"), torch.float32)
    small = dict(kv_cache_memory_bytes=per_tok * 16 * 16, max_num_batched_tokens=24)   # 256 tokens
    preempted, llm = _gen(oracle_dir, **small)
    assert llm.engine.num_preemptions > 0, "the small KV budget was meant to force preemption"
    assert preempted == ref
    asyn, a_llm = _gen(oracle_dir, async_scheduling=True, **small)
    assert a_llm.engine.async_scheduling and a_llm.engine.num_preemptions > 0
    assert asyn == ref
    assert a_llm.engine.kv.usage() == 0.0 and not a_llm.engine.requests


def test_engine_rejects_a_bad_schema(oracle_dir):
    llm = LLM(oracle_dir, dtype="float32", kv_cache_memory_bytes=16 << 20)
    with pytest.raises(ValueError, match="cannot be enforced") as ei:
        llm.generate([[5, 6, 7]], SamplingParams(structured_outputs=SO(json={"type": "frobnicate"})), use_tqdm=False)
    assert ei.value.param == "response_format"


# ---- GLM tool calls ------------------------------------------------------------------------------
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "days", "unit"]}
SCHEMAS = {"get_weather": WEATHER, "noop": {"type": "object", "properties": {}}}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]


@pytest.mark.parametrize("mode,parallel,reasoning", [("required", True, "disabled"), ("required", False, "auto"),
                                                     ("named", True, "enabled"), ("named", False, "disabled")])
def test_glm_tool_call_format_is_xgrammars_glm_format(mode, parallel, reasoning):
    names = ("get_weather",) if mode == "named" else tuple(SCHEMAS)
    mine = glm_tool_call_format(SCHEMAS, names, mode, parallel, reasoning)
    choice = {"type": "function", "function": {"name": names[0]}} if mode == "named" else "required"
    theirs = xgr.get_model_structural_tag("glm_4_7", tools=TOOLS, tool_choice=choice, reasoning=reasoning,
                                          parallel_tool_calls=parallel, max_whitespace_cnt=MAX_WHITESPACE)
    assert xgr.StructuralTag.model_validate(mine).model_dump(mode="json") == theirs.model_dump(mode="json")
    assert glm_tool_call_format(SCHEMAS, names, "auto") is None and glm_tool_call_format(SCHEMAS, names, "none") is None


def _parse_calls(text: str) -> list[tuple[str, dict]]:
    """Oracle parser of GLM markup, as GLM's parsers read it: values stripped, then raw for string
    properties (and enums of strings), JSON for the rest."""
    calls = []
    for name, body in re.findall(r"<tool_call>([^<\s]+)(.*?)</tool_call>", text, flags=re.S):
        args = {}
        for k, v in re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", body, flags=re.S):
            prop = SCHEMAS[name]["properties"][k]
            raw = prop.get("type") == "string" or all(isinstance(e, str) for e in prop.get("enum", [0]))
            args[k] = v.strip() if raw else json.loads(v)
        calls.append((name, args))
    return calls


def test_constrained_tool_calls_from_the_random_model_validate(oracle_dir):
    llm = LLM(oracle_dir, dtype="float32", kv_cache_memory_bytes=32 << 20)
    sps = [SamplingParams(max_tokens=120, temperature=1.0, seed=s, structured_outputs=glm_tool_call_structured_outputs(
        SCHEMAS, ("get_weather",) if s % 2 else tuple(SCHEMAS), "named" if s % 2 else "required", parallel=False))
        for s in range(8)]
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts(8)], sps, use_tqdm=False)
    for s, o in enumerate(outs):
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        calls = _parse_calls(c.text)
        assert len(calls) == 1 and c.text.startswith("<tool_call>") and c.text.endswith("</tool_call>"), c.text
        name, args = calls[0]
        assert name == "get_weather" or s % 2 == 0
        jsonschema.validate(args, SCHEMAS[name])
    assert glm_tool_call_structured_outputs(SCHEMAS, tuple(SCHEMAS), "auto") is None
