"""Decode CUDA graphs on the GPU (worker/cuda_graph.py): replay == eager while requests join and finish
over 64+ steps, contexts crossing index_topk (dense -> sparse graphs) and batch sizes between buckets.

fp32: the same greedy tokens, logprobs within 1e-3 (the graphs' padded batch rows change cuBLAS's
algorithm choice, so equal only to reduction order). bf16: the kernels (Triton MLA decode, indexer,
routing) inside graphs; this random tiny model is chaotic under bf16 rounding (tests/gpu/test_gpu_engine.py),
so only the first decode step's logprob of eager's token is compared (within 0.05), and the rest must run.
"""
from __future__ import annotations

import pytest
import torch

from glm_ray import LLM, SamplingParams
from glm_ray.engine.engine_core import summarize_steps

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU present")]


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(10, 1000, (n,), generator=g).tolist()} for n in (3, 40, 9, 17, 5, 70, 2)]


def _run(path, dtype, eager):
    llm = LLM(path, device="cuda", dtype=dtype, kv_cache_memory_bytes=256 << 20, max_num_seqs=8,
              max_model_len=1024, enforce_eager=eager)
    runner = llm.engine.executor.worker.runner
    assert (runner.graphs is None) == eager
    sps = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=3) for n in (70, 5, 66, 20, 64, 9, 33)]
    outs = llm.generate(_prompts(), sps, use_tqdm=False)
    return outs, runner


def test_graph_replay_equals_eager_fp32(oracle_dir):
    torch.backends.cuda.matmul.allow_tf32 = False
    eager, _ = _run(oracle_dir, "float32", True)
    graph, runner = _run(oracle_dir, "float32", False)
    assert runner.num_graph_steps >= 60 and len(runner.graphs.graphs) > 1
    for a, b in zip(eager, graph):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert ta == tb
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys() and max(abs(x[t] - y[t]) for t in x) < 1e-3


def test_graph_replay_bf16_runs_the_kernels(oracle_dir):
    eager, _ = _run(oracle_dir, "bfloat16", True)
    graph, runner = _run(oracle_dir, "bfloat16", False)
    assert runner.num_graph_steps >= 60
    for a, b in zip(eager, graph):
        assert len(b.outputs[0].token_ids) == len(a.outputs[0].token_ids)
        assert a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0]    # the prefill's token: eager in both
        # the first decode step (a graph replay vs eager) from the same input token
        x, y = a.outputs[0].logprobs[1], b.outputs[0].logprobs[1]
        tok = a.outputs[0].token_ids[1]
        if tok in y:
            assert abs(x[tok] - y[tok]) < 0.05


def _sparse_decode_step(oracle_dir):
    """An eager bf16 engine (kept: it owns the runner), its runner and one decode step's inputs: 4
    sequences of 30 tokens (past index_topk: the indexer scores)."""
    from glm_ray.forward_batch import build_forward_batch
    llm = LLM(oracle_dir, device="cuda", dtype="bfloat16", kv_cache_memory_bytes=256 << 20, enforce_eager=True)
    w = llm.engine.executor.worker
    r = w.runner
    B, ctx = 4, 30                                               # contexts > index_topk: the sparse path
    tables = [list(range(i * 4, i * 4 + 4)) for i in range(B)]
    batch = build_forward_batch([1] * B, [ctx] * B, tables, r.block_size, w.device)
    return llm, r, torch.randint(10, 1000, (B,), device=w.device), batch


def test_decode_forward_has_no_host_sync(oracle_dir):
    """An eager decode forward under torch's sync debug mode "error": any .item()/.tolist()/nonzero or
    blocking copy raises. (A successful capture proves the same for the graph path.)"""
    _llm, r, ids, batch = _sparse_decode_step(oracle_dir)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            r.model(ids, batch, r.kv_caches, r.index_caches, r.state_caches)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_graph_decode_step_waits_on_the_gpu_once(oracle_dir):
    """A replayed decode step waits for the GPU once: on the event after the sampled tokens' copy to
    pinned memory (no synchronizing call that sync-debug mode sees — pageable copies of row indices or
    sampling parameters, or a `.tolist()` of device tensors, would wait for the replay mid-step)."""
    import warnings
    llm = LLM(oracle_dir, device="cuda", dtype="bfloat16", kv_cache_memory_bytes=256 << 20, max_num_seqs=8,
              max_model_len=1024, async_scheduling=False)     # (async steps launch and collect separately)
    runner = llm.engine.executor.worker.runner
    syncs, waits, orig = [], [], runner.execute
    event_sync = torch.cuda.Event.synchronize
    n_waits = [0]

    def counting_wait(ev):
        n_waits[0] += 1
        return event_sync(ev)

    def counted(step):
        graph = bool(step.seqs) and runner._graph_step(step.seqs)
        n_waits[0] = 0
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                out = orig(step)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if graph:
            syncs.append(sum("synchronizing" in str(x.message) for x in w))
            waits.append(n_waits[0])
        return out
    runner.execute = counted
    torch.cuda.Event.synchronize = counting_wait
    try:
        sps = [SamplingParams(max_tokens=12, temperature=t, top_p=0.9, seed=i, ignore_eos=True)
               for i, t in enumerate((0.0, 0.7, 1.0))]
        llm.generate(_prompts()[:3], sps, use_tqdm=False)
    finally:
        torch.cuda.Event.synchronize = event_sync
    assert len(syncs) >= 10 and max(syncs) == 0 and set(waits) == {1}, (syncs, waits)


def test_async_scheduling_equals_sync_with_graphs(oracle_dir):
    """Async scheduling with CUDA graphs (in-flight tokens patched into the graph's static ids on the
    device) == the synchronous loop: fp32, the same greedy tokens, logprobs within 1e-3."""
    torch.backends.cuda.matmul.allow_tf32 = False
    outs = []
    auto = LLM(oracle_dir, device="cuda", dtype="float32", kv_cache_memory_bytes=64 << 20, max_num_seqs=2)
    assert auto.engine.async_scheduling                     # the default on a GPU at TP=1
    del auto
    for async_scheduling in (False, True):
        llm = LLM(oracle_dir, device="cuda", dtype="float32", kv_cache_memory_bytes=256 << 20, max_num_seqs=8,
                  max_model_len=1024, async_scheduling=async_scheduling)
        assert llm.engine.async_scheduling == async_scheduling
        sps = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2) for n in (40, 5, 33, 20, 24, 9, 17)]
        outs.append(llm.generate(_prompts(), sps, use_tqdm=False))
        assert llm.engine.executor.worker.runner.num_graph_steps >= 30
    for a, b in zip(*outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys() and max(abs(x[t] - y[t]) for t in x) < 1e-3


def test_step_timeline_with_graphs(oracle_dir, monkeypatch):
    """GLM_RAY_STEP_TIMELINE on the GPU: CUDA-event marks around every replayed step, read after the
    step's one host wait (the sync-count test above holds without them); device time within the step's
    wall time in the synchronous loop, a gap measured for every step after the first in both loops. (Which loop
    leaves the device idler is bench.orchestration's question: at this tiny model's 0.2-0.4 ms gaps the order
    flipped between two H200 runs.)"""
    monkeypatch.setenv("GLM_RAY_STEP_TIMELINE", "1")
    for async_scheduling in (False, True):
        llm = LLM(oracle_dir, device="cuda", dtype="bfloat16", kv_cache_memory_bytes=256 << 20, max_num_seqs=8,
                  max_model_len=1024, async_scheduling=async_scheduling)
        llm.generate(_prompts()[:4], SamplingParams(max_tokens=48, temperature=0, ignore_eos=True), use_tqdm=False)
        steps = [s for s in llm.engine.step_history if s.num_decode_seqs == s.num_tokens > 0]
        assert len(steps) >= 40 and all("device" in s.worker_timings and "gap" in s.worker_timings for s in steps[1:])
        if not async_scheduling:
            assert all(s.worker_timings["device"] <= s.step_s for s in steps)
        assert summarize_steps(steps)["gap_ms"] >= 0
        del llm


def test_shared_expert_side_stream_equals_one_stream(oracle_dir, monkeypatch):
    """Layers of <= GLM_RAY_SIDE_STREAM_TOKENS tokens fork work onto a side stream (kernels/streams.py: MoE
    shared experts, MLA cache writes), inside the decode graphs too: the same kernels on the same inputs,
    so the same greedy tokens and the same logprobs bit for bit as one stream."""
    from glm_ray.kernels import streams
    torch.backends.cuda.matmul.allow_tf32 = False
    monkeypatch.setenv("GLM_RAY_SIDE_STREAM_TOKENS", "0")
    one, runner = _run(oracle_dir, "float32", False)
    moes = [m for m in runner.model.modules() if type(m).__name__ == "MoE"]
    assert moes and all(m.shared_experts is not None and m.side_stream_tokens == 0 for m in moes)
    assert all(m.side_stream_tokens == 0 for m in runner.model.modules() if type(m).__name__ == "MLAAttention")
    monkeypatch.setenv("GLM_RAY_SIDE_STREAM_TOKENS", "64")
    two, runner = _run(oracle_dir, "float32", False)
    assert runner.num_graph_steps >= 60 and streams._STREAMS                # the fork ran (and was captured)
    for a, b in zip(one, two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_decode_step_selects_once_per_indexer_layer(oracle_dir, monkeypatch):
    """A decode step that scores makes its DSA selections on the side stream inside `project` (MLAQuery
    .selections, carried by the model to `attend`): one `select` per full-indexer layer, not a second
    one in `attend` (a regression measured on the H200: twice the indexer's scores and top-k a step)."""
    from glm_ray.layers.indexer import Indexer
    _llm, r, ids, batch = _sparse_decode_step(oracle_dir)
    calls = []
    real = Indexer.select
    monkeypatch.setattr(Indexer, "select", lambda self, *a, **k: calls.append(self) or real(self, *a, **k))
    with torch.inference_mode():
        r.model(ids, batch, r.kv_caches, r.index_caches, r.state_caches)
    torch.cuda.synchronize()
    indexers = {id(m) for m in r.model.modules() if isinstance(m, Indexer)}   # (the MTP layer's included)
    assert calls and len(calls) == len(set(map(id, calls))) and set(map(id, calls)) <= indexers   # each once
