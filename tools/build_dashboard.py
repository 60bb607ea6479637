#!/usr/bin/env python3
"""Generate the Grafana dashboard deploy/grafana/glm-ray.json from plain Python dicts.

    python tools/build_dashboard.py           # (re)write deploy/grafana/glm-ray.json
    python tools/build_dashboard.py --check   # exit 1 if the committed file is stale

No dependencies beyond the standard library. The output is the modern dashboard model
(`datasource: {type: prometheus, uid: "${datasource}"}` on every panel and target), validated
by tests/deploy/test_dashboard.py against the JSON Schema generated from @grafana/schema.
After changing this file, also run `python tools/gen_k8s.py` (the k8s ConfigMap embeds the JSON).

Queries read the metrics of glm_ray/serve/metrics.py as Ray exports them (`ray_glm_ray_*`,
counters with `_total`) plus Ray Serve's own `ray_serve_*` metrics. Every engine query carries
the filter `ray_io_cluster=~"$cluster", model=~"$model", fp8_proj=~"$fp8_proj"`; on a local run
without KubeRay there is no `ray_io_cluster` label and the "All" value (`.*`) still matches.
Latency quantiles are split by `fp8_proj` so an A/B run of the FP8 projection GEMM reads off
one panel. deploy/prometheus/rules.yaml records the same quantiles over 5m for alerts.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUTPUT = REPO / "deploy" / "grafana" / "glm-ray.json"

UID = "glm-ray-serving"
TITLE = "glm-ray / GLM-5 serving"
SCHEMA_VERSION = 41

DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
CLUSTER = 'ray_io_cluster=~"$cluster"'
ENGINE = f'{CLUSTER}, model=~"$model", fp8_proj=~"$fp8_proj"'
P = "ray_glm_ray_"                       # Ray's export prefix + our metric prefix
QUANTILES = (0.5, 0.9, 0.99)
# Default of `fp8_proj_min_tokens`: prefill batches above it take the FP8 projection GEMM.
FP8_PROJ_MIN_TOKENS = 512


# ----------------------------------------------------------------------------- query helpers

def rate(series: str, sel: str = ENGINE) -> str:
    return f"rate({series}{{{sel}}}[{RATE}])"


def quantile(q: float, histogram: str, by: str, sel: str = ENGINE) -> str:
    by_le = f"{by}, le" if by else "le"
    return f"histogram_quantile({q}, sum by ({by_le}) ({rate(histogram + '_bucket', sel)}))"


def pct(q: float) -> str:
    return f"p{round(q * 100):d}"


# ----------------------------------------------------------------------------- panel helpers

class Layout:
    """Places panels left to right on Grafana's 24-column grid, wrapping into new lines."""

    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.x = 0
        self.y = 0
        self.line_h = 0
        self.next_id = 1

    def _pos(self, w: int, h: int) -> dict:
        if self.x + w > 24:
            self.x, self.y, self.line_h = 0, self.y + self.line_h, 0
        pos = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.x += w
        self.line_h = max(self.line_h, h)
        return pos

    def _id(self) -> int:
        i = self.next_id
        self.next_id += 1
        return i

    def row(self, title: str) -> None:
        if self.x:
            self.x, self.y, self.line_h = 0, self.y + self.line_h, 0
        self.panels.append({"collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
                            "id": self._id(), "panels": [], "title": title, "type": "row"})
        self.y += 1

    def add(self, panel: dict, w: int, h: int) -> None:
        panel = {"id": self._id(), "gridPos": self._pos(w, h), **panel}
        self.panels.append(panel)


def target(expr: str, legend: str, ref: str) -> dict:
    return {"datasource": DS, "editorMode": "code", "expr": expr, "legendFormat": legend,
            "range": True, "refId": ref}


def targets(*pairs: tuple[str, str]) -> list[dict]:
    return [target(e, leg, chr(ord("A") + i)) for i, (e, leg) in enumerate(pairs)]


def field_defaults(unit: str, *, decimals: int | None = None, max_: float | None = None,
                   thresholds: list[tuple[float | None, str]] | None = None,
                   color_mode: str = "palette-classic", custom: dict | None = None) -> dict:
    steps = [{"color": c, "value": v} for v, c in (thresholds or [(None, "green")])]
    d: dict = {"color": {"mode": color_mode}, "unit": unit,
               "thresholds": {"mode": "absolute", "steps": steps}}
    if custom is not None:
        d["custom"] = custom
    if decimals is not None:
        d["decimals"] = decimals
    if max_ is not None:
        d["min"] = 0
        d["max"] = max_
    return d


def timeseries(title: str, description: str, tgts: list[dict], unit: str, *,
               max_: float | None = None, stack: bool = False,
               thresholds: list[tuple[float | None, str]] | None = None) -> dict:
    custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if stack else 0,
              "showPoints": "never", "spanNulls": False,
              "stacking": {"group": "A", "mode": "normal" if stack else "none"},
              "thresholdsStyle": {"mode": "line" if thresholds else "off"}}
    return {
        "type": "timeseries", "title": title, "description": description, "datasource": DS,
        "fieldConfig": {"defaults": field_defaults(unit, max_=max_, thresholds=thresholds,
                                                   custom=custom),
                        "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "showLegend": True,
                               "calcs": ["mean", "max", "lastNotNull"]},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": tgts,
    }


def stat(title: str, description: str, expr: str, unit: str, *,
         thresholds: list[tuple[float | None, str]] | None = None, decimals: int | None = None
         ) -> dict:
    return {
        "type": "stat", "title": title, "description": description, "datasource": DS,
        "fieldConfig": {"defaults": field_defaults(unit, decimals=decimals, thresholds=thresholds,
                                                   color_mode="thresholds"),
                        "overrides": []},
        "options": {"colorMode": "value", "graphMode": "area", "justifyMode": "auto",
                    "orientation": "auto", "textMode": "auto",
                    "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
        "targets": [target(expr, title, "A")],
    }


def quantile_panel(title: str, description: str, histogram: str, unit: str,
                   by: str = "model, fp8_proj", quantiles=QUANTILES, sel: str = ENGINE,
                   legend_by: str = "{{model}} fp8_proj={{fp8_proj}}") -> dict:
    tgts = targets(*[(quantile(q, histogram, by, sel), f"{pct(q)} {legend_by}")
                     for q in quantiles])
    return timeseries(title, description, tgts, unit)


# ----------------------------------------------------------------------------- variables

def query_variable(name: str, label: str, query: str, description: str) -> dict:
    return {
        "name": name, "label": label, "type": "query", "description": description,
        "datasource": DS,
        "query": {"query": query, "refId": f"PrometheusVariableQueryEditor-{name}"},
        "refresh": 2, "sort": 1, "regex": "", "hide": 0,
        "includeAll": True, "multi": True, "allValue": ".*",
        "current": {"selected": True, "text": "All", "value": "$__all"},
        "options": [],
    }


def variables() -> list[dict]:
    ds = {
        "name": "datasource", "label": "Data source", "type": "datasource",
        "query": "prometheus", "regex": "", "hide": 0, "refresh": 1,
        "includeAll": False, "multi": False, "options": [],
        "description": "Prometheus that scrapes the Ray pods (PodMonitors in k8s/).",
    }
    cluster = query_variable(
        "cluster", "Ray cluster", f"label_values({P}requests_running, ray_io_cluster)",
        "KubeRay cluster (the ray_io_cluster label set by the PodMonitors). "
        "Empty on a local run; 'All' still matches.")
    model = query_variable(
        "model", "Model", f'label_values({P}requests_running{{{CLUSTER}}}, model)',
        "served_model_name of the Router replicas.")
    fp8 = {
        "name": "fp8_proj", "label": "FP8 proj GEMM", "type": "custom",
        "description": "The prefill-only FP8 projection GEMM flag (fp8_proj_gemm) of a Router.",
        "query": "off,on", "hide": 0, "includeAll": True, "multi": True, "allValue": ".*",
        "current": {"selected": True, "text": "All", "value": "$__all"},
        "options": [{"selected": True, "text": "All", "value": "$__all"},
                    {"selected": False, "text": "off", "value": "off"},
                    {"selected": False, "text": "on", "value": "on"}],
    }
    return [ds, cluster, model, fp8]


# ----------------------------------------------------------------------------- the dashboard

def build_panels() -> list[dict]:
    lay = Layout()

    lay.row("Overview")
    overview = [
        stat("Requests / s", "Requests finished per second (all finish reasons).",
             f"sum({rate(P + 'requests_finished_total')})", "reqps", decimals=2),
        stat("Output tokens / s", "Generated tokens per second, all replicas.",
             f"sum({rate(P + 'generation_tokens_total')})", "short", decimals=0),
        stat("TTFT p99", "99th percentile time to first token, all replicas.",
             quantile(0.99, P + "time_to_first_token_seconds", ""), "s",
             thresholds=[(None, "green"), (2.0, "orange"), (5.0, "red")]),
        stat("ITL p99", "99th percentile inter-token latency, all replicas.",
             quantile(0.99, P + "inter_token_latency_seconds", ""), "s",
             thresholds=[(None, "green"), (0.1, "orange"), (0.25, "red")]),
        stat("KV cache usage (max)", "Fullest KV cache among the Router replicas.",
             f"max({P}kv_cache_usage_ratio{{{ENGINE}}})", "percentunit",
             thresholds=[(None, "green"), (0.9, "orange"), (0.98, "red")]),
        stat("Healthy Router replicas", "Ray Serve's health gauge for the Router deployment.",
             f'sum(ray_serve_deployment_replica_healthy{{{CLUSTER}, deployment="Router"}})',
             "none", decimals=0, thresholds=[(None, "red"), (1, "green")]),
    ]
    for p in overview:
        lay.add(p, 4, 4)

    lay.row("Latency by FP8 projection flag")
    lay.add(quantile_panel(
        "Time to first token",
        "TTFT from arrival at the Router to the first output token: p50/p90/p99 per model and "
        "fp8_proj. The FP8 projection GEMM only touches prefill, so this is where it shows.",
        P + "time_to_first_token_seconds", "s"), 12, 9)
    lay.add(quantile_panel(
        "Inter-token latency",
        "Gap between consecutive output tokens of a request (one sample per token after the "
        "first): p50/p90/p99 per model and fp8_proj.",
        P + "inter_token_latency_seconds", "s"), 12, 9)
    lay.add(quantile_panel(
        "Time per output token",
        "Per request (e2e - ttft) / (output tokens - 1): p50/p90/p99.",
        P + "time_per_output_token_seconds", "s"), 8, 8)
    lay.add(quantile_panel(
        "End-to-end request latency",
        "Arrival at the Router to the last token: p50/p90/p99.",
        P + "e2e_request_latency_seconds", "s"), 8, 8)
    lay.add(quantile_panel(
        "Queue time",
        "Arrival at the Router to first scheduling: p50/p99.",
        P + "queue_time_seconds", "s", quantiles=(0.5, 0.99)), 8, 8)

    lay.row("Throughput and requests")
    lay.add(timeseries(
        "Token throughput",
        "Output (generated) and prompt tokens per second of finished requests.",
        targets(
            (f"sum by (model, fp8_proj) ({rate(P + 'generation_tokens_total')})",
             "output {{model}} fp8_proj={{fp8_proj}}"),
            (f"sum by (model, fp8_proj) ({rate(P + 'prompt_tokens_total')})",
             "prompt {{model}} fp8_proj={{fp8_proj}}")),
        "short"), 12, 8)
    lay.add(timeseries(
        "Finished requests by reason",
        "Requests finished per second, by finish_reason (stop, length, abort, error).",
        targets((f"sum by (model, finish_reason) ({rate(P + 'requests_finished_total')})",
                 "{{model}} {{finish_reason}}")),
        "reqps", stack=True), 12, 8)
    lay.add(timeseries(
        "Errors by type",
        "Failed or rejected requests per second by error_type (server_overloaded = queue full).",
        targets((f"sum by (model, error_type) ({rate(P + 'request_errors_total')})",
                 "{{model}} {{error_type}}")),
        "reqps", stack=True), 8, 8)
    errors = rate(P + "requests_finished_total", ENGINE + ', finish_reason="error"')
    lay.add(timeseries(
        "Error ratio",
        "Share of finished requests whose finish_reason is 'error' (the GlmRayHighErrorRatio "
        "alert fires above 5% for 5m).",
        targets((f"sum by (model) ({errors}) / sum by (model) "
                 f"({rate(P + 'requests_finished_total')})", "{{model}}")),
        "percentunit", max_=1, thresholds=[(None, "green"), (0.05, "red")]), 8, 8)
    lay.add(timeseries(
        "Preemptions",
        "Requests preempted per second (KV cache exhausted; they are recomputed later).",
        targets((f"sum by (model, fp8_proj) ({rate(P + 'preemptions_total')})",
                 "{{model}} fp8_proj={{fp8_proj}}")),
        "short"), 8, 8)

    lay.row("Scheduler and KV cache")
    lay.add(timeseries(
        "Running and waiting requests",
        "Requests in the running batch and in the waiting queue, summed over replicas.",
        targets((f"sum by (model) ({P}requests_running{{{ENGINE}}})", "running {{model}}"),
                (f"sum by (model) ({P}requests_waiting{{{ENGINE}}})", "waiting {{model}}")),
        "short"), 12, 8)
    lay.add(timeseries(
        "KV cache usage",
        "Fraction of KV-cache blocks in use, per Router replica.",
        targets((f"max by (model, replica) ({P}kv_cache_usage_ratio{{{ENGINE}}})",
                 "{{model}} {{replica}}")),
        "percentunit", max_=1, thresholds=[(None, "green"), (0.95, "red")]), 12, 8)
    prefill = P + "prefill_batch_tokens"
    lay.add(quantile_panel(
        "Prefill batch tokens",
        "Prompt tokens per engine step that ran prefill (chunks included): p50/p99.",
        prefill, "short", quantiles=(0.5, 0.99)), 8, 8)
    at_most = rate(prefill + "_bucket", ENGINE + f', le=~"{FP8_PROJ_MIN_TOKENS}(.0)?"')
    lay.add(timeseries(
        f"Prefill steps above {FP8_PROJ_MIN_TOKENS} tokens",
        f"Share of prefill steps with more than {FP8_PROJ_MIN_TOKENS} tokens: with the default "
        "fp8_proj_min_tokens these are the steps where the FP8 projection GEMM engages "
        "(when fp8_proj is on).",
        targets((f"1 - sum by (model, fp8_proj) ({at_most}) / sum by (model, fp8_proj) "
                 f"({rate(prefill + '_count')})", "{{model}} fp8_proj={{fp8_proj}}")),
        "percentunit", max_=1), 8, 8)
    lay.add(quantile_panel(
        "Decode batch size",
        "Requests per decode step: p50/p90/p99.",
        P + "decode_batch_size", "short"), 8, 8)
    hits, queries = rate(P + "prefix_cache_hits_total"), rate(P + "prefix_cache_queries_total")
    lay.add(timeseries(
        "Prefix cache hit rate",
        "Share of prompt tokens found in the prefix cache (not computed): hits / queries per model.",
        targets((f"sum by (model) ({hits}) / sum by (model) ({queries})", "{{model}}")),
        "percentunit", max_=1), 12, 8)
    lay.add(timeseries(
        "Prefix cache tokens / s",
        "Prompt tokens looked up in the prefix cache (queries) and found there (hits), per model.",
        targets((f"sum by (model) ({queries})", "queries {{model}}"),
                (f"sum by (model) ({hits})", "hits {{model}}")),
        "short"), 12, 8)

    lay.row("Ray Serve")
    lay.add(timeseries(
        "HTTP requests / s",
        "Requests through the Serve proxies by application and status code "
        "(ray_serve_num_http_requests_total).",
        targets((f"sum by (application, status_code) "
                 f"(rate(ray_serve_num_http_requests_total{{{CLUSTER}}}[{RATE}]))",
                 "{{application}} {{status_code}}")),
        "reqps", stack=True), 12, 8)
    lay.add(timeseries(
        "HTTP request latency",
        "Proxy-measured latency of whole HTTP requests (a streamed completion counts until its "
        "last chunk): p50/p90/p99 per application.",
        targets(*[(f"histogram_quantile({q}, sum by (application, le) "
                   f"(rate(ray_serve_http_request_latency_ms_bucket{{{CLUSTER}}}[{RATE}])))",
                   f"{pct(q)} {{{{application}}}}") for q in QUANTILES]),
        "ms"), 12, 8)
    lay.add(timeseries(
        "Deployment processing latency",
        "Time a replica spends on one call, per deployment (OpenAIIngress, Router): p50/p99.",
        targets(*[(f"histogram_quantile({q}, sum by (deployment, le) "
                   f"(rate(ray_serve_deployment_processing_latency_ms_bucket{{{CLUSTER}}}[{RATE}])))",
                   f"{pct(q)} {{{{deployment}}}}") for q in (0.5, 0.99)]),
        "ms"), 12, 8)
    lay.add(timeseries(
        "Healthy replicas",
        "Healthy replicas per deployment (ray_serve_deployment_replica_healthy).",
        targets((f"sum by (application, deployment) "
                 f"(ray_serve_deployment_replica_healthy{{{CLUSTER}}})",
                 "{{application}} {{deployment}}")),
        "none"), 12, 8)
    return lay.panels


def build_dashboard() -> dict:
    return {
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts", "type": "dashboard"}]},
        "description": "glm-ray: GLM-5-family models on Ray Serve. TTFT/ITL split by the FP8 "
                       "projection GEMM flag, throughput, scheduler and KV cache, Ray Serve. "
                       "Generated by tools/build_dashboard.py; do not edit by hand.",
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [],
        "panels": build_panels(),
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "tags": ["glm-ray", "ray-serve", "llm"],
        "templating": {"list": variables()},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "title": TITLE,
        "uid": UID,
        "version": 1,
    }


def render() -> str:
    return json.dumps(build_dashboard(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the committed file is stale")
    ap.add_argument("-o", "--output", type=Path, default=OUTPUT)
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text() if args.output.exists() else None
        if current != text:
            print(f"{args.output} is stale: run python tools/build_dashboard.py", file=sys.stderr)
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"wrote {args.output} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
