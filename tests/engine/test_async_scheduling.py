"""Async scheduling (step N+1 scheduled and launched before step N's tokens are read back) returns
exactly what the synchronous loop returns: greedy and seeded sampling, logprobs, stop strings and stop
token ids (one extra token is computed and discarded), max_tokens, n > 1, penalties and min_tokens (whose
sampling reads the host's outputs), chunked prefill with prompt logprobs, preemption, and aborts
mid-stream; the scheduler never schedules past a certain length finish. fp32 on CPU.

Token ids, finish reasons and the top-logprob token sets are compared exactly; the logprob values to fp32
round-off (`same_outputs`): the extra token a stopping request computes under async scheduling changes the
next step's batch rows, and some CPUs' GEMMs (MKL's kernel choice depends on M) then round the other rows'
logits differently in the 7th digit."""
from __future__ import annotations

import torch

from glm_ray import LLM, SamplingParams


def same_outputs(a, b, tol: float = 1e-5) -> bool:
    """Equal structures: ints, strings, None, token-id dict keys exactly; floats (logprobs) within `tol`."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= tol
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_outputs(a[k], b[k], tol) for k in a)
    if isinstance(a, (list, tuple)):
        return (isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(same_outputs(x, y, tol) for x, y in zip(a, b)))
    return a == b


def _ids(n, seed):
    return torch.randint(10, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [_ids(n, 100 + n) for n in (5, 23, 3, 40, 11, 17)]


def _params(stop_tok: int):
    return [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2),
            SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
            SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=3, n=2, ignore_eos=True),
            SamplingParams(max_tokens=18, temperature=0, ignore_eos=True, stop_token_ids=[stop_tok]),
            SamplingParams(max_tokens=14, temperature=0.7, seed=11, repetition_penalty=1.3,
                           presence_penalty=0.5, frequency_penalty=0.3, min_tokens=6, ignore_eos=True),
            SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, prompt_logprobs=2)]


def _run(path, params, async_scheduling: bool, **kw):
    kw.setdefault("kv_cache_memory_bytes", 32 << 20)
    llm = LLM(path, dtype="float32", async_scheduling=async_scheduling, **kw)
    assert llm.engine.async_scheduling == async_scheduling
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, c.logprobs) for c in o.outputs] + [o.prompt_logprobs] for o in outs], llm


def _stop_token(path) -> int:
    """A token the greedy request 3 emits mid-way (so the stop really fires)."""
    outs, _ = _run(path, [SamplingParams(max_tokens=18, temperature=0, ignore_eos=True)] * len(PROMPTS), False)
    return outs[3][0][0][5]


def test_async_equals_sync(oracle_dir):
    params = _params(_stop_token(oracle_dir))
    sync, _ = _run(oracle_dir, params, False)
    asyn, llm = _run(oracle_dir, params, True)
    assert same_outputs(asyn, sync)
    assert sync[3][0][1] == "stop" and len(sync[3][0][0]) == 6          # the stop token ended it
    assert all(len(c[0]) == 12 for c in sync[2][:2])                      # n = 2, max_tokens
    assert llm.engine.scheduler.num_unfinished == 0 and not llm.engine.requests
    assert llm.engine.kv.usage() == 0.0                                   # every block back


def test_async_equals_sync_chunked_and_preempted(oracle_dir):
    from glm_ray.config import ModelConfig
    from glm_ray.worker.cache import kv_bytes_per_token
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)] * len(PROMPTS)
    per_tok = kv_bytes_per_token(ModelConfig.from_pretrained(oracle_dir, "float32"), torch.float32)
    kw = dict(kv_cache_memory_bytes=per_tok * 16 * 9, max_num_batched_tokens=13)
    sync, s_llm = _run(oracle_dir, params, False, **kw)
    asyn, a_llm = _run(oracle_dir, params, True, **kw)
    assert s_llm.engine.num_preemptions > 0 and a_llm.engine.num_preemptions > 0
    assert same_outputs(asyn, sync)


def test_abort_mid_stream_frees_everything(oracle_dir):
    """Requests stepped by hand: one aborted while its next token is in flight; the others' outputs
    equal the synchronous engine's."""
    def drive(async_scheduling):
        llm = LLM(oracle_dir, dtype="float32", kv_cache_memory_bytes=32 << 20, async_scheduling=async_scheduling)
        eng = llm.engine
        sp = SamplingParams(max_tokens=15, temperature=0, ignore_eos=True)
        for i, p in enumerate(PROMPTS[:4]):
            eng.add_request(f"r{i}", p, sp)
        got: dict[str, list[int]] = {}
        steps = 0
        while eng.has_unfinished():
            for d in eng.step():
                got.setdefault(d.request_id, []).extend(d.new_token_ids)
            steps += 1
            if steps == 6:
                assert eng.abort("r1")
        return got, eng
    sync, _ = drive(False)
    asyn, eng = drive(True)
    for r in ("r0", "r2", "r3"):
        assert asyn[r] == sync[r] and len(asyn[r]) == 15
    assert eng.kv.usage() == 0.0 and not eng.requests and eng._inflight is None


def test_no_step_past_a_certain_length_finish(oracle_dir):
    llm = LLM(oracle_dir, dtype="float32", kv_cache_memory_bytes=32 << 20, async_scheduling=True)
    eng = llm.engine
    eng.add_request("a", PROMPTS[0], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    scheduled = []
    real = eng.scheduler.schedule

    def spy():
        out = real()
        scheduled.extend(len(s.token_ids) for s in out.seqs)
        return out
    eng.scheduler.schedule = spy
    while eng.has_unfinished():
        eng.step()
    assert scheduled == [len(PROMPTS[0]), 1, 1]     # prefill + 2 decodes: the 3rd token's step never runs


def test_async_on_the_graph_static_path(oracle_dir, monkeypatch):
    """The decode-graph path (static buffers, run without capture on CPU) takes the in-flight tokens
    from the device too (`DecodeGraphs.run(patch=...)`)."""
    from glm_ray.worker import model_runner
    monkeypatch.setattr(model_runner, "graphs_enabled", lambda cfg, device: True)
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)] * len(PROMPTS)
    sync, _ = _run(oracle_dir, params, False, max_num_seqs=8)
    asyn, llm = _run(oracle_dir, params, True, max_num_seqs=8)
    assert llm.engine.executor.worker.runner.num_graph_steps >= 8
    assert same_outputs(asyn, sync)


def test_offline_bench_ab_switches_the_loop(oracle_dir):
    """`bench.offline --scheduling sync async`: both loops on one engine, interleaved, rows say which."""
    from glm_ray.bench import offline
    rows = offline.run(oracle_dir, [2], 8, 6, scheduling=("sync", "async"), repeats=2, dtype="float32",
                       kv_cache_memory_bytes=32 << 20)
    assert [r["scheduling"] for r in rows] == ["sync", "async", "async", "sync"]
    assert all(r["decode_step_ms"] > 0 and r["output_tok_s"] > 0 for r in rows)


def test_auto_is_off_on_the_cpu(oracle_dir):
    """The default (async_scheduling=None) turns async scheduling on only where a device runs beside the
    host: on the CPU the host is the device, so steps run synchronously."""
    llm = LLM(oracle_dir, dtype="float32", kv_cache_memory_bytes=8 << 20)
    assert llm.config.async_scheduling is None and llm.engine.async_scheduling is False
