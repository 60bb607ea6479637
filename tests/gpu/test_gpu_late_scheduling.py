"""Late scheduling on the GPU (skipped without a CUDA/ROCm device): `EngineHost._loop` (no Ray) with its pacer over
the real runner — async scheduling, decode graphs, the step timeline's CUDA events feeding the pacer's device
times — while requests arrive from another thread at staggered times. The outputs must equal the synchronous
engine's (fp32, TF32 off: the same greedy tokens, logprobs within 1e-3, test_gpu_engine's bound), and the pacer
must have learned device and host times from real steps. tests/serve/test_late_scheduling.py checks the timing
rule itself on a simulated device."""
from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

from glm_ray import LLM, SamplingParams
from glm_ray.engine.pacing import StepPacer
from glm_ray.engine.stats_log import StatsLogger
from glm_ray.serve.engine_host import Admission, EngineHost

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU present")]

PROMPTS = [torch.randint(10, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (7, 33, 90, 12, 51, 20)]
PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)


def _served(path) -> tuple[dict[str, tuple[list[int], list[float]]], StepPacer]:
    llm = LLM(path, device="cuda", dtype="float32", async_scheduling=True, kv_cache_memory_bytes=256 << 20)
    eng = llm.engine
    assert eng.executor.worker.runner.timeline is not None, "late scheduling turns the device marks on"
    pacer = StepPacer()
    h = EngineHost.__new__(EngineHost)                                   # no rank actor: the loop alone
    h.engine, h.admission, h._wake, h._out = eng, Admission(), threading.Event(), queue.Queue()
    h.stats_log, h._dead, h._step_started, h.pacer = StatsLogger(eng, 0), None, None, pacer
    thread = threading.Thread(target=h._loop, daemon=True)
    thread.start()
    outs: dict[str, tuple[list[int], list[float]]] = {}
    try:
        for i, p in enumerate(PROMPTS):                                  # arrivals while others decode
            h.add(f"r{i}", p, PARAMS, PARAMS.max_tokens)
            time.sleep(0.004 * (i + 1))
        toks: dict[str, list[int]] = {}
        lps: dict[str, list[float]] = {}
        done = 0
        while done < len(PROMPTS):
            item = h._out.get(timeout=60)
            assert not isinstance(item, BaseException), item
            for d in item.deltas:
                toks.setdefault(d.request_id, []).extend(d.new_token_ids)
                for t, lp in zip(d.new_token_ids, d.new_logprobs or []):
                    lps.setdefault(d.request_id, []).append(lp[t])
                done += d.finished
        outs = {r: (toks[r], lps[r]) for r in toks}
    finally:
        h.stop()
        thread.join(timeout=30)
    return outs, pacer


def test_gpu_late_scheduling_outputs_equal_the_synchronous_engine(oracle_dir, monkeypatch):
    torch.backends.cuda.matmul.allow_tf32 = False
    monkeypatch.setenv("GLM_RAY_LATE_SCHEDULING", "1")
    served, pacer = _served(oracle_dir)
    assert pacer._device and pacer._host, "the pacer learned device and host times from the steps"
    monkeypatch.delenv("GLM_RAY_LATE_SCHEDULING")
    llm = LLM(oracle_dir, device="cuda", dtype="float32", async_scheduling=False, kv_cache_memory_bytes=256 << 20)
    ref = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    for i, o in enumerate(ref):
        c = o.outputs[0]
        toks, lps = served[f"r{i}"]
        assert toks == c.token_ids
        assert max(abs(a - lp[t]) for a, lp, t in zip(lps, c.logprobs, c.token_ids)) < 1e-3
