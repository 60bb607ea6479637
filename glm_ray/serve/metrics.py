"""Prometheus metrics of the serving engine: TTFT, ITL, TPOT, E2E, queue time, tokens, batches, KV usage.

Where they come from
    The `Router` deployment (one replica = one TP group) owns the scheduler, so it is the one place
    that sees every request's timeline. It creates one `EngineMetrics` and calls its `on_*` hooks
    from the engine loop.

How they reach Prometheus
    The metrics are Ray metrics, not `prometheus_client` ones (Ray does not collect the latter
    from actors). Inside a Serve replica they are `ray.serve.metrics` objects, which add the
    `deployment`, `replica` and `application` tags; elsewhere in a Ray job they are plain
    `ray.util.metrics` objects; without Ray (offline `LLM` use, unit tests) every hook is a no-op.
    Ray exports them on each node's metrics port (`ray start --metrics-export-port`, 8080 on
    KubeRay where the container port is named `metrics`) with a `ray_` prefix; counters get a
    `_total` suffix and histograms the usual `_bucket`/`_sum`/`_count`. A local check:

        curl -s 127.0.0.1:8080/metrics | grep '^ray_glm_ray_'

Names and labels
    Our label keys are `model` (served model name), `fp8_proj` ("on"/"off": the prefill-only FP8
    projection GEMM, so A/B runs share one dashboard) and `tp` (tensor-parallel size), plus
    `finish_reason` (stop|length|abort|error) on `requests_finished` and `error_type` on
    `request_errors` (the `EngineError.error_type` of what the Router counts: `ERROR_TYPES`, or any
    other identifier; free text becomes "other"). The dashboard (deploy/grafana/glm-ray.json), the Prometheus rules
    (deploy/prometheus/rules.yaml) and tests/deploy check their queries against `METRICS` below,
    so a rename here fails those tests until they follow.

Counting contract (what the Router calls when)
    - `on_first_token(ttft_s, queue_s)`: once per request, when its first output token is ready
      (TTFT = arrival -> first token; queue time = arrival -> first scheduled).
    - `on_tokens(itl_s)`: the gaps between consecutive output tokens of one request, one sample
      per token after the first (a step that emits k tokens for a request gives k samples).
    - `on_request_finished(...)`: exactly once per admitted request, whatever the finish reason;
      TPOT = (e2e - ttft) / (generated - 1), None when fewer than two tokens were generated.
    - `on_error(error_type)`: once per failure, including requests rejected before admission
      (which never reach `on_request_finished`). `error_type` is `EngineError.error_type`.
    - `on_step(...)`: once per engine step, and whenever the idle engine's gauges changed.

Hot path
    `on_tokens` and `on_step` run every engine step. Tags are bound once as default tags (no
    per-call dict), a gauge is set only when its value changed, zero counts are skipped, and a
    metrics failure is logged once and never propagates into the engine loop.
    Measured with Ray 2.60 on a 2-core CPU box: ~3.5 us per ITL sample, ~6 us per `on_step`.

Series from the first scrape
    Prometheus practice is to export every known label set at 0 from the start: a panel then
    shows 0 rather than "No data", and `rate()` sees the first increment (a series that appears
    at 1 has no earlier sample to rate against). `EngineMetrics()` therefore records, at
    construction, 0 on each counter for each known label set (the `model`/`fp8_proj`/`tp` set;
    `finish_reason` in `FINISH_REASONS`; `error_type` in `ERROR_TYPES`) and sets each gauge to 0.
    Ray's public `Counter.inc()` refuses 0 (Ray 2.60: "value must be >0"), so the zero goes
    through `Metric._record(0, tags)`, the method `inc()` itself ends in (after its own checks):
    the same tags, the same Cython metric, and an OpenTelemetry counter takes an add of 0 and
    exports the series at 0. It is private to Ray, hence `_export_zero` checks it exists and
    falls back to a logged no-op (the series then appear on their first increment, as before).
    Histograms cannot be pre-created through Ray 2.60: its metrics agent drops histogram points
    whose count is 0 (`ReporterAgent._export_histogram_data`), and observing a fake value would
    corrupt the latencies, so a histogram's `_bucket`/`_sum`/`_count` series appear with its
    first observation (its quantile panels have nothing to show before traffic anyway).

How fresh the gauges are
    The engine loops publish a `StepBatch` after every step and, when idle, as soon as the gauges
    moved (the aborts of a burst of disconnects), so `on_step` sets the gauge on the change.
    From there Ray exports every `metrics_report_interval_ms` (Ray's system config; Ray's default
    10000 ms): the value on /metrics trails the engine by up to that interval plus the scrape
    interval. `glm-ray serve --metrics-report-interval-ms` sets it for the Ray it starts (default
    2000); for a cluster started with `ray start` (KubeRay included) set the environment variable
    `RAY_metrics_report_interval_ms` on every node. Ray's agent also ages out a gauge series not
    set for 2 export intervals, so the Router re-sets the gauges every `gauge_refresh_s` (half
    the interval, 0.5..5 s) with `keep_gauges_fresh()`.

Ray-isms worth knowing
    - Ray computes a histogram's `_sum` from bucket midpoints, so `_sum / _count` (a mean) is an
      approximation; quantiles from `_bucket` are as good as the boundaries below.
    - Ray ages out a gauge series that has not been set for ~2 export intervals, hence
      `keep_gauges_fresh()`.
    - Boundaries are exported with a decimal point: `le="512.0"`, `le="0.1"`, `le="+Inf"`.
"""
from __future__ import annotations

import asyncio
import logging
import re
import sys
from dataclasses import dataclass
from typing import Any, Iterable

from glm_ray.engine.errors import EngineDeadError, EngineOverloadedError, RequestFailedError, StepOutOfMemoryError

logger = logging.getLogger(__name__)

#: Prefix of every metric this project defines (before Ray's export prefix).
METRIC_PREFIX = "glm_ray_"
#: Prefix Ray adds when it exports an application metric to Prometheus.
RAY_EXPORT_PREFIX = "ray_"

#: Label keys set on every metric (bound once per `EngineMetrics`).
LABEL_KEYS: tuple[str, ...] = ("model", "fp8_proj", "tp")
#: Tag keys Ray Serve adds by itself inside a replica (reserved: never use them as ours).
SERVE_TAG_KEYS: tuple[str, ...] = ("deployment", "replica", "application")
#: Allowed values of the `finish_reason` label.
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error")
#: The `error_type`s the Router counts (exported at 0 from the start): queue full, a request's step
#: failed, the device ran out of memory in a request's step, the engine died.
ERROR_TYPES: tuple[str, ...] = (EngineOverloadedError.error_type, RequestFailedError.error_type,
                                StepOutOfMemoryError.error_type, EngineDeadError.error_type)

# -------------------------------------------------------------------------------------------
# Bucket boundaries (seconds unless stated). LLM latencies span four orders of magnitude:
# a decode step of a 31B FP8 MoE on one H200 is ~0.8 ms at batch 1, a loaded prefill queue
# can push TTFT to tens of seconds, and a 32k-token generation runs for minutes.
# -------------------------------------------------------------------------------------------

#: Time to first token and queue time: 1 ms .. 10 min.
TTFT_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)
#: Inter-token latency and time per output token: 0.25 ms .. 30 s (a stalled stream).
ITL_BUCKETS_S: tuple[float, ...] = (
    0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.006, 0.008,
    0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
    0.75, 1.0, 2.0, 5.0, 10.0, 30.0,
)
#: End-to-end request latency: 10 ms .. 1 h.
E2E_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0,
    45.0, 60.0, 90.0, 120.0, 180.0, 240.0, 300.0, 450.0, 600.0, 900.0, 1200.0, 1800.0, 3600.0,
)
#: Tokens of one prefill batch (summed over its requests). 512 is a boundary on purpose: the FP8
#: projection GEMM engages for batches of more than `fp8_proj_min_tokens` (default 512) tokens.
PREFILL_TOKENS_BUCKETS: tuple[float, ...] = (
    1, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192,
    12288, 16384, 24576, 32768, 65536, 131072,
)
#: Requests in one decode batch.
DECODE_BATCH_BUCKETS: tuple[float, ...] = (
    1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 768, 1024,
)


@dataclass(frozen=True)
class MetricSpec:
    """One metric as defined here (`name` has no Ray prefix and no `_total` suffix)."""

    name: str
    kind: str                                 # "counter" | "gauge" | "histogram"
    description: str
    extra_tag_keys: tuple[str, ...] = ()
    boundaries: tuple[float, ...] | None = None

    @property
    def tag_keys(self) -> tuple[str, ...]:
        return LABEL_KEYS + self.extra_tag_keys

    @property
    def exported_name(self) -> str:
        """The metric family name as Prometheus sees it (Ray prefix; `_total` on counters)."""
        base = RAY_EXPORT_PREFIX + self.name
        return base + "_total" if self.kind == "counter" else base

    @property
    def series_names(self) -> tuple[str, ...]:
        """Every sample name Prometheus stores for this metric."""
        base = RAY_EXPORT_PREFIX + self.name
        if self.kind == "counter":
            return (base + "_total",)
        if self.kind == "histogram":
            return (base + "_bucket", base + "_sum", base + "_count")
        return (base,)


def _h(name: str, description: str, boundaries: tuple[float, ...]) -> MetricSpec:
    return MetricSpec(METRIC_PREFIX + name, "histogram", description, (), boundaries)


def _c(name: str, description: str, extra: tuple[str, ...] = ()) -> MetricSpec:
    return MetricSpec(METRIC_PREFIX + name, "counter", description, extra)


def _g(name: str, description: str) -> MetricSpec:
    return MetricSpec(METRIC_PREFIX + name, "gauge", description)


TIME_TO_FIRST_TOKEN = _h(
    "time_to_first_token_seconds",
    "Time from request arrival at the Router to its first output token, in seconds.",
    TTFT_BUCKETS_S)
INTER_TOKEN_LATENCY = _h(
    "inter_token_latency_seconds",
    "Time between two consecutive output tokens of one request, in seconds.",
    ITL_BUCKETS_S)
TIME_PER_OUTPUT_TOKEN = _h(
    "time_per_output_token_seconds",
    "Per request: (e2e - ttft) / (output tokens - 1), in seconds.",
    ITL_BUCKETS_S)
E2E_REQUEST_LATENCY = _h(
    "e2e_request_latency_seconds",
    "Time from request arrival at the Router to its last output token, in seconds.",
    E2E_BUCKETS_S)
QUEUE_TIME = _h(
    "queue_time_seconds",
    "Time a request waited in the Router's queue before it was first scheduled, in seconds.",
    TTFT_BUCKETS_S)
PREFILL_BATCH_TOKENS = _h(
    "prefill_batch_tokens",
    "Prompt tokens processed by one engine step that ran prefill (chunks included).",
    PREFILL_TOKENS_BUCKETS)
DECODE_BATCH_SIZE = _h(
    "decode_batch_size",
    "Requests decoded together by one engine step.",
    DECODE_BATCH_BUCKETS)
PROMPT_TOKENS = _c("prompt_tokens", "Prompt tokens of finished requests.")
GENERATION_TOKENS = _c("generation_tokens", "Output tokens of finished requests.")
REQUESTS_FINISHED = _c(
    "requests_finished", "Requests that finished, by finish reason (stop|length|abort|error).",
    ("finish_reason",))
PREEMPTIONS = _c("preemptions", "Requests preempted (KV blocks freed, to be recomputed).")
PREFIX_CACHE_QUERIES = _c(
    "prefix_cache_queries", "Prompt tokens looked up in the prefix cache (each admission of a request).")
PREFIX_CACHE_HITS = _c("prefix_cache_hits", "Of the prefix-cache queries, tokens found cached (not computed).")
REQUEST_ERRORS = _c(
    "request_errors", "Failed or rejected requests, by error type.", ("error_type",))
REQUESTS_RUNNING = _g("requests_running", "Requests in the running batch.")
REQUESTS_WAITING = _g("requests_waiting", "Requests waiting to be scheduled.")
KV_CACHE_USAGE = _g("kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0..1).")

#: Every metric this module defines, in a stable order.
METRICS: tuple[MetricSpec, ...] = (
    TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, TIME_PER_OUTPUT_TOKEN, E2E_REQUEST_LATENCY,
    QUEUE_TIME, PREFILL_BATCH_TOKENS, DECODE_BATCH_SIZE,
    PROMPT_TOKENS, GENERATION_TOKENS, REQUESTS_FINISHED, PREEMPTIONS, PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS,
    REQUEST_ERRORS,
    REQUESTS_RUNNING, REQUESTS_WAITING, KV_CACHE_USAGE,
)


def exported_series_names() -> set[str]:
    """All sample names (`ray_..._bucket`, `ray_..._total`, ...) these metrics produce."""
    return {n for m in METRICS for n in m.series_names}


# -------------------------------------------------------------------------------------------
# Backend selection
# -------------------------------------------------------------------------------------------

BACKENDS = ("serve", "ray", "noop")
#: Longest period of the gauge re-set (`keep_gauges_fresh`; Ray ages out gauges that are not re-set).
GAUGE_REFRESH_S = 5.0
#: Ray's default `metrics_report_interval_ms`, when the running Ray does not say.
RAY_DEFAULT_REPORT_INTERVAL_MS = 10_000


def report_interval_s() -> float:
    """Ray's metrics export interval in this process (`metrics_report_interval_ms`), in seconds."""
    try:
        import ray  # noqa: PLC0415 - only where Ray runs (the metrics are enabled)
        ms = ray._config.metrics_report_interval_ms()   # private, but Ray's own telemetry code reads it so
    except Exception:  # noqa: BLE001 - an older/newer Ray without it: assume its default
        ms = RAY_DEFAULT_REPORT_INTERVAL_MS
    return max(float(ms), 1000.0) / 1000.0            # Ray floors the export cadence at 1 s


def detect_backend() -> str:
    """"serve" inside a Serve replica, "ray" in another Ray process, "noop" without Ray.

    Nothing is imported here: a process that never imported `ray` cannot have initialized it,
    and one that never imported `ray.serve` cannot be a Serve replica.
    """
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return "noop"
    serve = sys.modules.get("ray.serve")
    if serve is not None:
        try:
            serve.get_replica_context()
            return "serve"
        except Exception:  # noqa: BLE001 - a probe: RayServeException (or any failure) = not in a replica
            pass
    return "ray"


def _metric_classes(backend: str) -> tuple[Any, Any, Any]:
    if backend == "serve":
        from ray.serve import metrics as m  # noqa: PLC0415 - ray: this module imports nothing of it
    else:
        from ray.util import metrics as m  # noqa: PLC0415 - ray: this module imports nothing of it
    return m.Counter, m.Gauge, m.Histogram


_ERROR_TYPE_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")


def _export_zero(metric: Any, tags: dict[str, str] | None) -> None:
    """Make `metric`'s series for `tags` exist at 0: `Metric._record(0)`, what `Counter.inc()` ends in
    (its public check refuses 0; why this route: the module docstring)."""
    record = getattr(metric, "_record", None)
    if record is None:
        raise AttributeError(f"{type(metric).__name__} has no _record: this Ray cannot export a counter at 0")
    record(0, tags)


def _label_error_type(error_type: str) -> str:
    # Keep the label's cardinality bounded: identifiers pass, free text does not.
    return error_type if isinstance(error_type, str) and _ERROR_TYPE_RE.match(error_type) \
        else "other"


class EngineMetrics:
    """The engine's metric hooks, bound to one model instance (one Router replica).

    `backend` is normally detected ("serve" | "ray" | "noop", see `detect_backend`); pass it to
    force one (tests). All hooks are cheap no-ops on the "noop" backend.
    """

    def __init__(self, model: str, fp8_proj: bool, tp: int, *, backend: str | None = None):
        self.labels: dict[str, str] = {
            "model": str(model), "fp8_proj": "on" if fp8_proj else "off", "tp": str(int(tp)),
        }
        self.backend = detect_backend() if backend is None else backend
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        self.enabled = self.backend != "noop"
        self._warned = False
        self._last_gauges: list[float] = [0.0, 0.0, 0.0]
        self._last_prefix = [0, 0]               # the engine's cumulative prefix-cache queries / hits seen
        self._metrics: dict[str, Any] = {}
        self.gauge_refresh_s = GAUGE_REFRESH_S
        if not self.enabled:
            return
        self.gauge_refresh_s = min(GAUGE_REFRESH_S, max(0.5, report_interval_s() / 2))

        counter_cls, gauge_cls, histogram_cls = _metric_classes(self.backend)
        for spec in METRICS:
            if spec.kind == "histogram":
                metric = histogram_cls(spec.name, description=spec.description,
                                       boundaries=list(spec.boundaries or ()),
                                       tag_keys=spec.tag_keys)
            elif spec.kind == "counter":
                metric = counter_cls(spec.name, description=spec.description,
                                     tag_keys=spec.tag_keys)
            else:
                metric = gauge_cls(spec.name, description=spec.description,
                                   tag_keys=spec.tag_keys)
            # Serve's set_default_tags adds its own deployment/replica/application tags to these.
            metric.set_default_tags(dict(self.labels))
            self._metrics[spec.name] = metric

        m = self._metrics
        # Bound methods, looked up once: the hooks below run every engine step.
        self._ttft = m[TIME_TO_FIRST_TOKEN.name].observe
        self._itl = m[INTER_TOKEN_LATENCY.name].observe
        self._tpot = m[TIME_PER_OUTPUT_TOKEN.name].observe
        self._e2e = m[E2E_REQUEST_LATENCY.name].observe
        self._queue = m[QUEUE_TIME.name].observe
        self._prefill_tokens = m[PREFILL_BATCH_TOKENS.name].observe
        self._decode_batch = m[DECODE_BATCH_SIZE.name].observe
        self._prompt_tokens = m[PROMPT_TOKENS.name].inc
        self._generation_tokens = m[GENERATION_TOKENS.name].inc
        self._finished = m[REQUESTS_FINISHED.name].inc
        self._preemptions = m[PREEMPTIONS.name].inc
        self._prefix = (m[PREFIX_CACHE_QUERIES.name].inc, m[PREFIX_CACHE_HITS.name].inc)
        self._errors = m[REQUEST_ERRORS.name].inc
        self._gauges = (m[REQUESTS_RUNNING.name].set, m[REQUESTS_WAITING.name].set,
                        m[KV_CACHE_USAGE.name].set)
        # One tags dict per label value, built once.
        self._finish_tags = {r: {"finish_reason": r} for r in FINISH_REASONS}
        self._error_tags: dict[str, dict[str, str]] = {e: {"error_type": e} for e in ERROR_TYPES}
        self._export_known_series()

    def _export_known_series(self) -> None:
        """Every counter at 0 for each known label set, every gauge at 0 (see "Series from the first
        scrape" in the module docstring)."""
        try:
            for spec in METRICS:
                metric = self._metrics[spec.name]
                if spec.kind == "gauge":
                    metric.set(0.0)
                elif spec.kind == "counter":
                    if spec is REQUESTS_FINISHED:
                        label_sets = list(self._finish_tags.values())
                    elif spec is REQUEST_ERRORS:
                        label_sets = list(self._error_tags.values())
                    else:
                        label_sets = [None]
                    for tags in label_sets:
                        _export_zero(metric, tags)
        except Exception as e:  # noqa: BLE001 - never fail the Router over a metric
            self._failed("exporting the series at 0", e)

    # ------------------------------------------------------------------ hooks

    def on_first_token(self, ttft_s: float, queue_s: float) -> None:
        if not self.enabled:
            return
        try:
            self._ttft(float(ttft_s))
            self._queue(float(queue_s))
        except Exception as e:  # noqa: BLE001 - never break the engine loop over a metric
            self._failed("on_first_token", e)

    def on_tokens(self, itl_s: Iterable[float]) -> None:
        if not self.enabled or not itl_s:
            return
        try:
            observe = self._itl
            for x in itl_s:
                observe(x if type(x) is float else float(x))
        except Exception as e:  # noqa: BLE001 - never break the engine loop over a metric
            self._failed("on_tokens", e)

    def on_request_finished(self, e2e_s: float, tpot_s: float | None, num_prompt_tokens: int,
                            num_generation_tokens: int, finish_reason: str) -> None:
        if not self.enabled:
            return
        try:
            self._e2e(float(e2e_s))
            if tpot_s is not None:
                self._tpot(float(tpot_s))
            if num_prompt_tokens > 0:
                self._prompt_tokens(int(num_prompt_tokens))
            if num_generation_tokens > 0:
                self._generation_tokens(int(num_generation_tokens))
            tags = self._finish_tags.get(finish_reason)
            if tags is None:
                self._warn_once(f"unknown finish_reason {finish_reason!r}, counted as 'error'")
                tags = self._finish_tags["error"]
            self._finished(1, tags)
        except Exception as e:  # noqa: BLE001 - never break the engine loop over a metric
            self._failed("on_request_finished", e)

    def on_error(self, error_type: str) -> None:
        if not self.enabled:
            return
        try:
            tags = self._error_tags.get(error_type)
            if tags is None:
                tags = {"error_type": _label_error_type(error_type)}
                if len(self._error_tags) < 256:
                    self._error_tags[error_type] = tags
            self._errors(1, tags)
        except Exception as e:  # noqa: BLE001 - never break the engine loop over a metric
            self._failed("on_error", e)

    def on_step(self, num_running: int, num_waiting: int, kv_usage: float, prefill_tokens: int,
                decode_batch_size: int, num_preemptions: int, prefix_queries: int = 0,
                prefix_hits: int = 0) -> None:
        """`prefix_queries` / `prefix_hits` are the engine's running totals (a lost step loses nothing)."""
        if not self.enabled:
            return
        try:
            for i, total in enumerate((prefix_queries, prefix_hits)):
                if total > self._last_prefix[i]:
                    self._prefix[i](int(total - self._last_prefix[i]))
                self._last_prefix[i] = total
            last = self._last_gauges
            for i, value in enumerate((num_running, num_waiting, kv_usage)):
                if value != last[i]:
                    self._gauges[i](float(value))
                    last[i] = value
            if prefill_tokens > 0:
                self._prefill_tokens(int(prefill_tokens))
            if decode_batch_size > 0:
                self._decode_batch(int(decode_batch_size))
            if num_preemptions > 0:
                self._preemptions(int(num_preemptions))
        except Exception as e:  # noqa: BLE001 - never break the engine loop over a metric
            self._failed("on_step", e)

    def refresh_gauges(self) -> None:
        """Re-set every gauge to its last value (Ray's agent drops a gauge series not set for 2 export
        intervals)."""
        if not self.enabled:
            return
        try:
            for set_gauge, value in zip(self._gauges, self._last_gauges):
                set_gauge(float(value))
        except Exception as e:  # noqa: BLE001 - never break the Router over a metric
            self._failed("refresh_gauges", e)

    async def keep_gauges_fresh(self) -> None:
        """`refresh_gauges()` every `gauge_refresh_s`, forever (a task of the Router's event loop, the
        loop `on_step` runs on); returns at once when the metrics are off."""
        while self.enabled:
            await asyncio.sleep(self.gauge_refresh_s)
            self.refresh_gauges()

    # ------------------------------------------------------------------ internals

    def _failed(self, hook: str, exc: Exception) -> None:
        self._warn_once(f"{hook} failed: {exc!r}")

    def _warn_once(self, msg: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("EngineMetrics: %s (further metric warnings suppressed)", msg)

    def __repr__(self) -> str:
        return f"EngineMetrics(backend={self.backend!r}, labels={self.labels!r})"
