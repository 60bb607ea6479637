"""glm_ray/serve/metrics.py offline: the metric table, the no-op path and the recording logic."""
from __future__ import annotations

import re
import sys

import pytest

from glm_ray.serve import metrics as gm

EXPECTED = {
    "histogram": {
        "glm_ray_time_to_first_token_seconds", "glm_ray_inter_token_latency_seconds",
        "glm_ray_time_per_output_token_seconds", "glm_ray_e2e_request_latency_seconds",
        "glm_ray_queue_time_seconds", "glm_ray_prefill_batch_tokens", "glm_ray_decode_batch_size",
    },
    "counter": {
        "glm_ray_prompt_tokens", "glm_ray_generation_tokens", "glm_ray_requests_finished",
        "glm_ray_preemptions", "glm_ray_request_errors", "glm_ray_prefix_cache_queries", "glm_ray_prefix_cache_hits",
    },
    "gauge": {
        "glm_ray_requests_running", "glm_ray_requests_waiting", "glm_ray_kv_cache_usage_ratio",
    },
}


def test_metric_table_matches_the_contract():
    got = {kind: {m.name for m in gm.METRICS if m.kind == kind} for kind in EXPECTED}
    assert got == EXPECTED
    assert len({m.name for m in gm.METRICS}) == len(gm.METRICS)
    by_name = {m.name: m for m in gm.METRICS}
    assert by_name["glm_ray_requests_finished"].extra_tag_keys == ("finish_reason",)
    assert by_name["glm_ray_request_errors"].extra_tag_keys == ("error_type",)
    assert gm.LABEL_KEYS == ("model", "fp8_proj", "tp")
    assert gm.FINISH_REASONS == ("stop", "length", "abort", "error")


def test_exported_names():
    names = gm.exported_series_names()
    for n in ("ray_glm_ray_time_to_first_token_seconds_bucket",
              "ray_glm_ray_time_to_first_token_seconds_count",
              "ray_glm_ray_generation_tokens_total", "ray_glm_ray_requests_finished_total",
              "ray_glm_ray_kv_cache_usage_ratio"):
        assert n in names
    assert not any(n.endswith("_total_total") for n in names)
    assert gm.REQUESTS_FINISHED.exported_name == "ray_glm_ray_requests_finished_total"


@pytest.mark.parametrize("spec", gm.METRICS, ids=lambda s: s.name)
def test_metric_spec_is_valid(spec):
    assert re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", spec.name), "Ray drops invalid names"
    assert spec.name.startswith(gm.METRIC_PREFIX)
    assert spec.description
    assert not set(spec.tag_keys) & set(gm.SERVE_TAG_KEYS), "reserved by Ray Serve"
    assert len(set(spec.tag_keys)) == len(spec.tag_keys)
    if spec.kind == "counter":
        assert not spec.name.endswith("_total"), "Ray appends _total itself"
    if spec.kind == "histogram":
        b = spec.boundaries
        assert b and all(x > 0 for x in b), "Ray requires positive boundaries"
        assert list(b) == sorted(set(b)), "strictly increasing"
    else:
        assert spec.boundaries is None


def test_buckets_cover_llm_latencies():
    # TTFT / queue: from a millisecond to minutes.
    assert gm.TTFT_BUCKETS_S[0] <= 0.001 and gm.TTFT_BUCKETS_S[-1] >= 300
    # ITL / TPOT: sub-millisecond decode steps (H200 batch-1 floor ~0.76 ms) up to stalls.
    assert gm.ITL_BUCKETS_S[0] <= 0.0005 and gm.ITL_BUCKETS_S[-1] >= 10
    assert sum(1 for b in gm.ITL_BUCKETS_S if 0.0005 <= b <= 0.01) >= 8, "resolution where ITL lives"
    # E2E: long generations run for many minutes.
    assert gm.E2E_BUCKETS_S[-1] >= 1800
    # The FP8 projection threshold (fp8_proj_min_tokens=512) is a bucket boundary.
    assert 512 in gm.PREFILL_TOKENS_BUCKETS
    assert gm.DECODE_BATCH_BUCKETS[0] == 1 and gm.DECODE_BATCH_BUCKETS[-1] >= 512


def _call_every_hook(m: gm.EngineMetrics) -> None:
    m.on_first_token(0.123, 0.004)
    m.on_tokens([0.01, 0.012, 0.009])
    m.on_tokens([])
    m.on_request_finished(2.5, 0.0105, 1024, 200, "stop")
    m.on_request_finished(0.2, None, 10, 1, "length")
    m.on_request_finished(0.1, None, 10, 0, "abort")
    m.on_error("server_overloaded")
    m.on_step(4, 2, 0.37, 1536, 4, 1)
    m.on_step(0, 0, 0.0, 0, 0, 0)


def test_offline_without_ray_is_a_noop():
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        pytest.skip("Ray is initialized in this test process")
    m = gm.EngineMetrics("tiny", fp8_proj=False, tp=1)
    assert m.backend == "noop" and not m.enabled
    assert m.labels == {"model": "tiny", "fp8_proj": "off", "tp": "1"}
    _call_every_hook(m)


def test_detect_backend_without_ray_initialized():
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        pytest.skip("Ray is initialized in this test process")
    assert gm.detect_backend() == "noop"


def test_bad_backend_is_rejected():
    with pytest.raises(ValueError):
        gm.EngineMetrics("m", True, 8, backend="prometheus")


# ---------------------------------------------------------------- the recording logic, with fakes

class _Fake:
    """Ray's metric classes as far as EngineMetrics uses them: `_record` is where every public call
    ends (Ray 2.60's Metric._record), `inc` refuses what Ray's refuses."""
    instances: list["_Fake"] = []

    def __init__(self, name, description="", boundaries=None, tag_keys=None):
        self.name, self.description, self.boundaries = name, description, boundaries
        self.tag_keys = tag_keys
        self.default_tags: dict = {}
        self.calls: list[tuple] = []
        _Fake.instances.append(self)

    def set_default_tags(self, tags):
        assert set(tags) <= set(self.tag_keys)
        self.default_tags = tags
        return self

    def _record(self, value, tags=None):
        assert isinstance(value, (int, float)) and type(value) is not bool
        final = {**self.default_tags, **(tags or {})}
        assert set(final) == set(self.tag_keys), (self.name, final, self.tag_keys)
        self.calls.append((value, tags))

    def observe(self, value, tags=None):
        self._record(value, tags)

    def set(self, value, tags=None):
        self._record(value, tags)

    def inc(self, value=1.0, tags=None):
        assert value > 0, "Ray rejects non-positive increments"
        self._record(value, tags)


class _FakeCounter(_Fake):
    def __init__(self, name, description="", tag_keys=None):
        super().__init__(name, description, None, tag_keys)


class _FakeGauge(_FakeCounter):
    pass


class _FakeHistogram(_Fake):
    pass


@pytest.fixture
def fake_metrics(monkeypatch):
    _Fake.instances = []
    monkeypatch.setattr(gm, "_metric_classes",
                        lambda backend: (_FakeCounter, _FakeGauge, _FakeHistogram))
    m = gm.EngineMetrics("glm-5", fp8_proj=True, tp=8, backend="ray")
    made = {f.name: f for f in _Fake.instances}
    for f in made.values():                     # what construction recorded: test_known_series_start_at_zero
        f.startup, f.calls = f.calls, []
    return m, made


def test_every_metric_is_created_with_its_tags(fake_metrics):
    m, made = fake_metrics
    assert m.enabled and set(made) == {s.name for s in gm.METRICS}
    for spec in gm.METRICS:
        f = made[spec.name]
        assert f.tag_keys == spec.tag_keys
        assert f.default_tags == {"model": "glm-5", "fp8_proj": "on", "tp": "8"}
        if spec.kind == "histogram":
            assert f.boundaries == list(spec.boundaries)


def test_hooks_record_what_they_should(fake_metrics):
    m, made = fake_metrics
    _call_every_hook(m)
    vals = lambda name: [v for v, _ in made[name].calls]  # noqa: E731
    assert vals("glm_ray_time_to_first_token_seconds") == [0.123]
    assert vals("glm_ray_queue_time_seconds") == [0.004]
    assert vals("glm_ray_inter_token_latency_seconds") == [0.01, 0.012, 0.009]
    assert vals("glm_ray_e2e_request_latency_seconds") == [2.5, 0.2, 0.1]
    assert vals("glm_ray_time_per_output_token_seconds") == [0.0105]
    assert vals("glm_ray_prompt_tokens") == [1024, 10, 10]
    assert vals("glm_ray_generation_tokens") == [200, 1]           # zero is skipped
    assert [t for _, t in made["glm_ray_requests_finished"].calls] == [
        {"finish_reason": "stop"}, {"finish_reason": "length"}, {"finish_reason": "abort"}]
    assert made["glm_ray_request_errors"].calls == [(1, {"error_type": "server_overloaded"})]
    assert vals("glm_ray_requests_running") == [4.0, 0.0]
    assert vals("glm_ray_requests_waiting") == [2.0, 0.0]
    assert vals("glm_ray_kv_cache_usage_ratio") == [0.37, 0.0]
    assert vals("glm_ray_prefill_batch_tokens") == [1536]
    assert vals("glm_ray_decode_batch_size") == [4]
    assert vals("glm_ray_preemptions") == [1]


def test_labels_stay_bounded(fake_metrics):
    m, made = fake_metrics
    m.on_request_finished(1.0, None, 5, 2, "made_up_reason")
    m.on_error("some free text with spaces: 42")
    m.on_error("invalid_request_error")
    assert made["glm_ray_requests_finished"].calls[-1][1] == {"finish_reason": "error"}
    assert [t for _, t in made["glm_ray_request_errors"].calls] == [
        {"error_type": "other"}, {"error_type": "invalid_request_error"}]


def test_known_series_start_at_zero(fake_metrics):
    """Construction makes every counter series with a known label set exist at 0 (through `_record`:
    Ray's `inc(0)` raises) and sets every gauge to 0; histograms record nothing (a fake observation
    would be counted)."""
    m, made = fake_metrics
    for spec in gm.METRICS:
        got = made[spec.name].startup
        if spec.kind == "histogram":
            assert got == [], spec.name
        elif spec.kind == "gauge":
            assert got == [(0.0, None)], spec.name
        elif spec is gm.REQUESTS_FINISHED:
            assert got == [(0, {"finish_reason": r}) for r in ("stop", "length", "abort", "error")]
        elif spec is gm.REQUEST_ERRORS:
            assert sorted(t["error_type"] for _, t in got) == sorted(
                ["server_overloaded", "engine_error", "out_of_memory", "engine_dead"])
            assert all(v == 0 for v, _ in got)
        else:
            assert got == [(0, None)], spec.name


def test_error_types_are_the_router_counted_ones():
    """ERROR_TYPES (exported at 0) are the engine errors the Router counts: 503 queue full, 500/503 a
    failed step, 503 a dead engine."""
    from glm_ray.engine import errors
    assert set(gm.ERROR_TYPES) == {errors.EngineOverloadedError.error_type, errors.RequestFailedError.error_type,
                                   errors.StepOutOfMemoryError.error_type, errors.EngineDeadError.error_type}
    assert all(gm._label_error_type(e) == e for e in gm.ERROR_TYPES)


def test_gauges_are_set_on_change_and_refreshed(fake_metrics):
    m, made = fake_metrics
    running, kv = made["glm_ray_requests_running"], made["glm_ray_kv_cache_usage_ratio"]
    for _ in range(50):
        m.on_step(3, 0, 0.5, 0, 3, 0)
    assert [v for v, _ in running.calls] == [3.0], "set once on the change, not every step"
    m.on_step(4, 0, 0.5, 0, 3, 0)
    assert [v for v, _ in running.calls] == [3.0, 4.0] and [v for v, _ in kv.calls] == [0.5]
    m.refresh_gauges()
    assert [v for v, _ in running.calls] == [3.0, 4.0, 4.0] and [v for v, _ in kv.calls] == [0.5, 0.5]
    assert [v for v, _ in made["glm_ray_requests_waiting"].calls] == [0.0]    # 0 since construction


def test_keep_gauges_fresh_refreshes_on_its_period(fake_metrics):
    import asyncio
    m, made = fake_metrics
    m.on_step(2, 1, 0.25, 0, 2, 0)
    m.gauge_refresh_s = 0.01

    async def run_for(seconds):
        task = asyncio.ensure_future(m.keep_gauges_fresh())
        await asyncio.sleep(seconds)
        task.cancel()

    asyncio.run(run_for(0.2))
    sets = [v for v, _ in made["glm_ray_requests_running"].calls]
    assert len(sets) >= 5 and set(sets) == {2.0}, sets


@pytest.mark.parametrize("interval_s,want", [(10.0, 5.0), (2.0, 1.0), (1.0, 0.5)])
def test_gauge_refresh_follows_rays_export_interval(monkeypatch, interval_s, want):
    """Ray's agent drops a gauge not set for 2 export intervals: refresh every half interval (<= 5 s)."""
    monkeypatch.setattr(gm, "_metric_classes", lambda backend: (_FakeCounter, _FakeGauge, _FakeHistogram))
    monkeypatch.setattr(gm, "report_interval_s", lambda: interval_s)
    assert gm.EngineMetrics("m", False, 1, backend="ray").gauge_refresh_s == want
    assert gm.EngineMetrics("m", False, 1, backend="noop").gauge_refresh_s == gm.GAUGE_REFRESH_S


def test_report_interval_is_rays():
    ray = pytest.importorskip("ray")
    assert gm.report_interval_s() == max(ray._config.metrics_report_interval_ms(), 1000) / 1000


def test_numpy_values_are_converted(fake_metrics):
    np = pytest.importorskip("numpy")
    m, made = fake_metrics
    # numpy.int64 is not an `int` to Ray's type check; the hooks convert.
    m.on_step(np.int64(2), np.int64(1), np.float32(0.25), np.int64(600), np.int64(2), np.int64(0))
    m.on_first_token(np.float64(0.5), np.float32(0.25))
    m.on_tokens([np.float32(0.5), 1])
    m.on_request_finished(np.float64(3.0), np.float32(0.01), np.int64(7), np.int64(3), "stop")
    assert made["glm_ray_prefill_batch_tokens"].calls[-1][0] == 600
    assert made["glm_ray_inter_token_latency_seconds"].calls[-2:] == [(0.5, None), (1.0, None)]
    assert made["glm_ray_generation_tokens"].calls[-1][0] == 3


def test_a_failing_metric_never_breaks_the_engine(monkeypatch, caplog):
    def boom(self, value, tags=None):
        raise RuntimeError("exporter down")

    monkeypatch.setattr(_Fake, "_record", boom)
    monkeypatch.setattr(gm, "_metric_classes",
                        lambda backend: (_FakeCounter, _FakeGauge, _FakeHistogram))
    m = gm.EngineMetrics("glm-5", fp8_proj=True, tp=8, backend="ray")
    with caplog.at_level("WARNING", logger=gm.__name__):
        _call_every_hook(m)
    assert sum("EngineMetrics" in r.getMessage() for r in caplog.records) == 1, "warned once"
