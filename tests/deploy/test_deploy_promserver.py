"""The promserver helper against a real Prometheus and a tiny prometheus_client exporter."""
from __future__ import annotations

import os

import pytest
from deploy_helpers import RULES, tool
from promserver import PromQueryError, free_port, prometheus_server


@pytest.fixture
def exporter():
    from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

    registry = CollectorRegistry()
    requests = Counter("demo_requests", "Requests.", ["model"], registry=registry)
    depth = Gauge("demo_queue_depth", "Queue depth.", registry=registry)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        yield f"127.0.0.1:{port}", requests, depth
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_prometheus_scrapes_a_loopback_exporter(exporter):
    tool("prometheus")
    target, requests, depth = exporter
    requests.labels(model="tiny").inc(3)
    depth.set(7)
    # Our rules load as well (they stay empty: nothing here exports ray_* metrics).
    with prometheus_server([target], job="demo", rule_files=[RULES]) as prom:
        assert prom.pid and os.path.exists(f"/proc/{prom.pid}")
        prom.wait_for('up{job="demo"} == 1', timeout=30)
        got = prom.wait_for('demo_requests_total{model="tiny"}', timeout=30)
        assert float(got[0]["value"][1]) == 3.0
        assert prom.query_values("demo_queue_depth") == {
            (("__name__", "demo_queue_depth"), ("instance", target), ("job", "demo")): 7.0}
        # A counter change shows up in rate() once two scrapes saw it.
        requests.labels(model="tiny").inc(10)
        prom.wait_for('increase(demo_requests_total{model="tiny"}[10s]) > 0', timeout=30)
        assert {g["name"] for g in prom.rules()} >= {"glm-ray.latency", "glm-ray.alerts"}
        # "unknown" until a group's first evaluation, never "err".
        assert {r["health"] for g in prom.rules() for r in g["rules"]} <= {"ok", "unknown"}
        with pytest.raises(PromQueryError):
            prom.query("sum by (model (demo_requests_total)")
        with pytest.raises(TimeoutError):
            prom.wait_for("demo_does_not_exist", timeout=0.5)
        pid = prom.pid
    assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid), "stopped by PID"


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except OSError:
        return True
