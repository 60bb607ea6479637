"""GLM_RAY_STEP_TIMELINE: rank 0 reports each step's device time and the device's idle gap before it
(worker/step_timeline.py), and `summarize_steps` their medians — checked against the step's own wall time
on the CPU, where the device is the host (the gap is then the host's work between two forwards)."""
import pytest

from glm_ray import LLM, SamplingParams
from glm_ray.engine.engine_core import summarize_steps


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_timeline_marks_every_step(tiny_dir, monkeypatch, async_scheduling):
    monkeypatch.setenv("GLM_RAY_STEP_TIMELINE", "1")
    llm = LLM(tiny_dir, device="cpu", dtype="float32", max_num_seqs=4, kv_cache_memory_bytes=8 << 20,
              async_scheduling=async_scheduling)
    outs = llm.generate([{"prompt_token_ids": list(range(10, 10 + n))} for n in (5, 9, 13)],
                        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    steps = [s for s in llm.engine.step_history if s.num_tokens]
    timed = [s for s in steps if "device" in s.worker_timings]
    assert len(timed) == len(steps)
    assert "gap" not in timed[0].worker_timings and all("gap" in s.worker_timings for s in timed[1:])
    for s in timed:
        w = s.worker_timings
        assert 0 < w["device"] and w.get("gap", 0) >= 0
        if not async_scheduling:        # the step's wall time holds its compute (async: steps overlap)
            assert w["device"] <= s.step_s
    r = summarize_steps(steps)
    assert r["device_ms"] > 0 and r["gap_ms"] >= 0 and 0 <= r["gap_share"] < 1


def test_no_marks_by_default(tiny_dir):
    llm = LLM(tiny_dir, device="cpu", dtype="float32", max_num_seqs=2, kv_cache_memory_bytes=8 << 20)
    llm.generate([{"prompt_token_ids": [11, 12, 13]}], SamplingParams(max_tokens=3), use_tqdm=False)
    assert llm.engine.executor.worker.runner.timeline is None
    assert all("device" not in s.worker_timings for s in llm.engine.step_history)
