"""A request's failure stays the request's (offline engine, TP=1, CPU, fp32).

Faults are injected through the worker's real hook (GLM_RAY_FAULT_INJECTION, worker/faults.py): an
exception or an OOM in the forward fails exactly the requests of that step; an exception in sampling
fails exactly the poisoned row. Their KV blocks and state slots come back, the batch-mates' tokens
equal a clean run's (the oracle: the same engine without the poisoned request), and the engine keeps
serving. Bad parameters fail fast in the offline API with the same rules as the HTTP API, and leave
the `LLM` usable.
"""
from __future__ import annotations

import pytest
import torch

from glm_ray import LLM, SamplingParams
from glm_ray.engine.errors import InvalidRequestError
from glm_ray.worker.faults import ENV, FaultInjector, classify

SP = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
POISON_FORWARD, POISON_OOM, POISON_SAMPLE = 900, 901, 902


def _ids(n, seed):
    return torch.randint(10, 800, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def llm(oracle_dir):
    mp = pytest.MonkeyPatch()
    mp.setenv(ENV, f"exception@{POISON_FORWARD},oom@{POISON_OOM},sample@{POISON_SAMPLE}")
    try:
        yield LLM(oracle_dir, dtype="float32", kv_cache_memory_bytes=32 << 20)
    finally:
        mp.undo()


def _run(llm, prompts, sp=SP):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [(o.outputs[0].finish_reason, o.outputs[0].token_ids) for o in outs]


def _assert_idle(llm):
    eng = llm.engine
    assert not eng.has_unfinished() and not eng.requests
    assert eng.kv.usage() == 0.0, "a failed request's KV blocks were not freed"
    assert sorted(eng.scheduler._free_slots) == list(range(eng.cfg.scheduler.max_num_seqs))


def test_sampler_failure_fails_only_that_row(llm):
    clean = [_ids(9, 1), _ids(23, 2)]
    ref = _run(llm, clean)
    poisoned = _ids(15, 3)[:7] + [POISON_SAMPLE] + _ids(15, 3)[7:]
    out = _run(llm, [clean[0], poisoned, clean[1]])
    assert out[1] == ("error", [])
    assert [out[0], out[2]] == ref and all(r == "length" for r, _ in ref)
    _assert_idle(llm)


@pytest.mark.parametrize("poison,kind", [(POISON_FORWARD, "engine_error"), (POISON_OOM, "out_of_memory")])
def test_forward_failure_fails_the_step_and_the_engine_goes_on(llm, poison, kind):
    ref = _run(llm, [_ids(11, 4)])
    # all three prefill in the same step: all three fail, with the error type of the fault
    eng = llm.engine
    seen = []
    step = eng.step

    def recording_step():
        deltas = step()
        seen.extend(d for d in deltas if d.finish_reason == "error")
        return deltas
    eng.step = recording_step
    try:
        out = _run(llm, [_ids(11, 4), [5, poison, 6], _ids(7, 5)])
    finally:
        del eng.step
    assert [r for r, _ in out] == ["error"] * 3
    assert {d.error_type for d in seen} == {kind} and all(d.error and "\n" not in d.error for d in seen)
    _assert_idle(llm)
    assert _run(llm, [_ids(11, 4)]) == ref                      # and the engine serves as before


def test_failure_mid_decode_keeps_the_others_decoding(llm):
    """A request that joins a running batch and fails in its prefill step takes down that step only."""
    a, b = _ids(13, 6), _ids(29, 7)
    ref = _run(llm, [a, b], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    eng = llm.engine
    for rid, p in (("x-a", a), ("x-b", b)):
        eng.add_request(rid, p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    got: dict[str, list[int]] = {"x-a": [], "x-b": []}
    reasons = {}
    for i in range(40):
        if i == 5:                                           # a and b are decoding now
            eng.add_request("x-bad", [7, POISON_FORWARD], SamplingParams(max_tokens=4))
        for d in eng.step():
            if d.request_id in got:
                got[d.request_id] += d.new_token_ids
            if d.finished:
                reasons[d.request_id] = d.finish_reason
        if not eng.has_unfinished():
            break
    # the step that held x-bad's prefill also held a's and b's decode: they fail with it ...
    assert reasons["x-bad"] == "error" and reasons["x-a"] == reasons["x-b"] == "error"
    assert got["x-a"] == ref[0][1][:len(got["x-a"])] and got["x-b"] == ref[1][1][:len(got["x-b"])]
    _assert_idle(llm)
    # ... and a request after it runs to the end, tokens as in a clean run
    assert _run(llm, [a, b], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)) == ref


@pytest.mark.parametrize("kw,param", [
    ({"seed": 2**64}, "seed"), ({"seed": -(2**63) - 1}, "seed"), ({"top_k": 2**63}, "top_k"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"), ({"top_p": float("nan")}, "top_p"),
    ({"stop_token_ids": [-5]}, "stop_token_ids"), ({"n": 10**9}, "n"), ({"max_tokens": 2**63}, "max_tokens"),
])
def test_bad_params_fail_fast_with_the_same_rules(kw, param):
    with pytest.raises(ValueError) as ei:
        SamplingParams(**kw)
    assert ei.value.param == param


def test_llm_stays_usable_after_a_bad_request(llm):
    ok = _run(llm, [_ids(5, 8)])
    vocab = llm.engine.model_cfg.vocab_size
    with pytest.raises(InvalidRequestError) as ei:              # stop id out of vocab, with min_tokens
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3, 4]}],
                     SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[vocab + 5]), use_tqdm=False)
    assert ei.value.param == "stop_token_ids"
    with pytest.raises(InvalidRequestError):                    # the second prompt is bad: nothing runs
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [vocab]}], SP, use_tqdm=False)
    _assert_idle(llm)
    assert _run(llm, [_ids(5, 8)]) == ok


def test_seed_extremes_and_choice_seeds(llm):
    for seed in (2**63 - 1, -(2**63)):
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, seed=seed, n=2),
                           use_tqdm=False)
        assert [c.finish_reason for c in out[0].outputs] == ["length", "length"]


def test_fault_spec_and_classification():
    f = FaultInjector.parse("exception@1, oom@2,sample@3")
    assert (f.exception_tokens, f.oom_tokens, f.sample_tokens) == ({1}, {2}, {3})
    with pytest.raises(ValueError):
        FaultInjector.parse("boom@1")
    assert classify(torch.OutOfMemoryError("x")) == "oom" and classify(MemoryError()) == "oom"
    assert classify(RuntimeError("DefaultCPUAllocator: can't allocate memory")) == "oom"
    assert classify(ValueError("x")) == "error"
