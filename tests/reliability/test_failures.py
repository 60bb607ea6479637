"""Failures the server must survive, on the deployed apps: 4x its KV capacity at once ("faults":
a 1280-token KV cache), a storm of clients that disconnect mid-stream ("glm-ray"), and faults
injected inside a step ("faults", GLM_RAY_FAULT_INJECTION: an exception and an OOM in the forward,
an exception in the sampler). Worker death is tests/serve/test_router_robustness.py's (and the long
script's, mid-stream)."""
from __future__ import annotations

import json

import pytest

from tests.reliability import harness as H

USES_CLUSTER = True


def test_overload_4x_kv_capacity_loses_nothing(faults_app, ray_driver):
    out = H.run_overload(faults_app.base_url, faults_app.model, ray_driver, "faults", faults_app.max_model_len,
                         factor=4.0, timeout=300)
    print(json.dumps(out))
    assert out["factor"] >= 4.0
    assert out["lost"] == 0, f"{out['lost']} of {out['requests']} requests lost: {out['lost_examples']}"
    assert out["completed"] + out["rejected"] == out["requests"]
    assert out["completed"] >= 1
    # it was an overload: the KV filled up (or requests queued / were preempted)
    assert out["peak"]["kv_usage"] >= 0.75 or out["peak"]["waiting"] > 0 or out["preemptions"], out["peak"]
    assert out["idle_after_s"] is not None, f"KV/running not back to 0 after the overload: {out['stats_after']}"
    assert out["alive_after"]


def test_disconnect_storm_frees_everything_within_2s(main_app, ray_driver):
    out = H.run_disconnect_storm(main_app.base_url, main_app.model, ray_driver, "glm-ray", n=20, chunks=3,
                                 max_tokens=1000, budget_s=120)
    print(json.dumps(out))
    assert out["mid_stream_disconnects"] == out["streams"], f"not every client got mid-stream: {out['other']}"
    assert out["drain_s"] is not None and out["drain_s"] <= 2.0, \
        f"running/waiting/KV not back to 0 within 2 s of the last disconnect: {out['drain_s']} {out['stats_after']}"
    assert out["alive_after"]


@pytest.mark.parametrize("kind", ["exception", "oom", "sample"])
def test_injected_fault_fails_only_its_requests(faults_app, ray_driver, kind):
    ok, detail = H.is_healthy(faults_app.base_url, faults_app.model)
    assert ok, f"faults app not serving before the test: {detail}"
    out = H.run_injected_fault(faults_app.base_url, faults_app.model, ray_driver, "faults", kind, timeout=120)
    print(json.dumps(out))
    assert not out["problems"], f"injected {kind}:\n" + "\n".join(out["problems"])
