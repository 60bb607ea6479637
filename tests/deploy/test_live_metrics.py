"""Live metrics: a real Prometheus scrapes the session's Ray cluster while the tiny apps serve.

One Prometheus (tests/deploy/promserver.py) on 127.0.0.1 scrapes Ray's metrics export port
(`serve_cluster.metrics_port`, where Ray exposes our `ray_glm_ray_*` metrics) every second and
loads deploy/prometheus/rules.yaml. The official `openai` client drives a little traffic to the
"glm-ray" app (fp8_proj off) and the "fp8on" app (fp8_proj on); then:

- series with fp8_proj="on" and fp8_proj="off" exist for the TTFT and ITL histograms;
- every dashboard query (variables substituted) is accepted by that Prometheus, and all but an
  explicit list (traffic we cannot produce here) return finite data;
- `promtool check metrics` passes on our own metric families as Ray exports them;
- the recording rules evaluate to data for both fp8_proj values, and every rule is healthy.

Timeline (2-core CI box): Prometheus scrapes first ~5 s after start, Ray's agent exports what
the replicas recorded every few seconds, and a `rate()` needs two scrapes after a change. So
traffic comes in two phases: phase 1 makes the series exist in Prometheus, phase 2 (after
Prometheus has seen them) makes every counter/histogram increase between two scrapes, which
makes rate()-based panels non-empty even when the series existed before this module.
"""
from __future__ import annotations

import json
import math
import re
import shutil
import time
import urllib.request

import pytest
from deploy_helpers import (
    DASHBOARD,
    RULES,
    iter_panels,
    load_yaml,
    run,
    substitute_grafana_vars,
    tool,
)
from promserver import PromServer

from glm_ray.serve import metrics as gm

TIMEOUT = 120
MAX_TOKENS = 8
JOB = "ray"
OUR_PREFIX = gm.RAY_EXPORT_PREFIX + gm.METRIC_PREFIX          # "ray_glm_ray_"
APPS = {"glm-ray": "off", "fp8on": "on"}                      # app name -> its fp8_proj label

#: Dashboard panels whose queries may come back empty here, and why. Every other query must
#: return at least one finite sample. None: our counters exist at 0 from the start (errors by
#: type, the error ratio's numerator, preemptions), so even the panels of what light traffic never
#: causes show 0 rather than "No data" (tests/deploy/test_first_scrape.py checks it before traffic).
ALLOWED_EMPTY: dict[str, str] = {}

#: Ray's own standard labels (camelCase: promtool's lint rejects them). Ray 2.60 puts them on the
#: gauge series it exports, ours included.
RAY_STANDARD_LABELS = ("Component", "NodeAddress", "SessionName", "Version", "WorkerId")


# --------------------------------------------------------------------------- traffic

def _clients(serve_cluster):
    import openai

    out = {}
    for name in APPS:
        app = serve_cluster.apps[name]
        out[name] = (openai.OpenAI(base_url=app.base_url + "/v1", api_key="EMPTY",
                                   max_retries=0, timeout=TIMEOUT), app.model)
    return out


def _completion(client, model, prompt):
    r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == MAX_TOKENS, r.usage


def _streamed_chat(client, model, text):
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=MAX_TOKENS,
        temperature=0.7, seed=1, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
    assert usage is not None and usage.completion_tokens == MAX_TOKENS, usage


def _bad_request(client, model):
    import openai

    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="bad", max_tokens=MAX_TOKENS,
                                  temperature=-1.0)


def _phase(clients, first: bool) -> int:
    """One round of traffic per app: 4 requests per app in phase 1, 3 in phase 2.

    A bad request (400) in each phase, so the 400 series of Ray Serve's HTTP counter both
    exists and increases."""
    n = 0
    for name, (client, model) in clients.items():
        _completion(client, model, f"Metrics for {name}, phase {'one' if first else 'two'}:")
        _streamed_chat(client, model, f"Tell me about {name}.")
        _bad_request(client, model)
        n += 3
        if first:
            _completion(client, model, "The quick brown fox jumps over the lazy dog")
            n += 1
    return n


# --------------------------------------------------------------------------- fixtures

def _fast_rules(tmp_path) -> str:
    """rules.yaml with every group evaluated each second instead of every 30 s.

    Only `interval` changes (names, expressions, labels are the file's own), so the recorded
    series show up within seconds instead of up to 30 s after the data."""
    rules = load_yaml(RULES)
    for group in rules["groups"]:
        group["interval"] = "1s"
    path = tmp_path / "rules.fast.yaml"
    path.write_text(json.dumps(rules))      # JSON is YAML
    return str(path)


def _fp8_values(prom, expr: str) -> set[str]:
    return {r["metric"].get("fp8_proj") for r in prom.query(expr)}


#: What the phases wait for, per series: the label that tells the two apps apart and its values.
#: Ray Serve's own series are exported by other processes (proxy, replicas) on their own clock,
#: so they are waited for as well: a series that first appears with both phases already in it
#: has no increase to rate() over.
WATCHED = [
    ("ray_glm_ray_generation_tokens_total", "fp8_proj", set(APPS.values())),
    ("ray_glm_ray_time_to_first_token_seconds_count", "fp8_proj", set(APPS.values())),
    ("ray_glm_ray_inter_token_latency_seconds_count", "fp8_proj", set(APPS.values())),
    ("ray_glm_ray_prefill_batch_tokens_count", "fp8_proj", set(APPS.values())),
    ("ray_serve_num_http_requests_total", "application", set(APPS)),
    ("ray_serve_http_request_latency_ms_count", "application", set(APPS)),
    ("ray_serve_deployment_processing_latency_ms_count", "application", set(APPS)),
]


def _wait_label(prom, expr: str, label: str, values: set[str], timeout: float) -> None:
    prom.wait_for(expr, timeout=timeout,
                  predicate=lambda res: {r["metric"].get(label) for r in res} >= values)


def _wait_watched(prom, rate: bool, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for name, label, values in WATCHED:
        expr = (f"sum by ({label}) (rate({name}[1m])) > 0" if rate
                else f"sum by ({label}) ({name})")
        _wait_label(prom, expr, label, values, timeout=max(deadline - time.monotonic(), 1.0))


@pytest.fixture(scope="module")
def live(request, tmp_path_factory):
    if shutil.which("prometheus") is None:      # checked before the (slow) cluster start
        pytest.skip("prometheus binary not found on PATH "
                    "(apt-get install -y --no-install-recommends prometheus)")
    serve_cluster = request.getfixturevalue("serve_cluster")
    tmp = tmp_path_factory.mktemp("live-metrics")
    timings: dict[str, float] = {}
    requests = 0
    t0 = time.monotonic()
    prom = PromServer([f"127.0.0.1:{serve_cluster.metrics_port}"], job=JOB,
                      rule_files=[_fast_rules(tmp)], workdir=tmp / "prom")
    prom.start()
    try:
        prom.wait_for(f'up{{job="{JOB}"}} == 1', timeout=30)
        timings["first_scrape"] = time.monotonic() - t0
        clients = _clients(serve_cluster)
        requests += _phase(clients, first=True)
        timings["phase1_sent"] = time.monotonic() - t0
        _wait_watched(prom, rate=False, timeout=45)     # phase 1 reached Prometheus
        timings["phase1_scraped"] = time.monotonic() - t0
        requests += _phase(clients, first=False)
        timings["phase2_sent"] = time.monotonic() - t0
        # ... and phase 2 made every rate() positive. NOTE: Ray exports each process's metrics on its
        # own clock and a loaded 2-core CI box can lag by tens of seconds, so keep a trickle of phase-2
        # traffic going (every ~15 s) until every rate is positive, for up to 2 minutes.
        deadline = time.monotonic() + 120
        while True:
            try:
                _wait_watched(prom, rate=True, timeout=15)
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise
                requests += _phase(clients, first=False)
        timings["phase2_scraped"] = time.monotonic() - t0
        yield prom, serve_cluster, timings, requests
    finally:
        prom.stop()
        print(f"\nlive metrics: {requests} requests; timings (s since "
              f"Prometheus start): { {k: round(v, 1) for k, v in timings.items()} }")


# --------------------------------------------------------------------------- tests

def test_ttft_and_itl_series_for_fp8_proj_on_and_off(live):
    prom, cluster, _, _ = live
    for hist in ("ray_glm_ray_time_to_first_token_seconds", "ray_glm_ray_inter_token_latency_seconds"):
        for suffix in ("_bucket", "_count", "_sum"):
            assert _fp8_values(prom, f"count by (fp8_proj) ({hist}{suffix})") >= {"on", "off"}, \
                hist + suffix
        for app, fp8 in APPS.items():
            sel = f'{hist}_count{{application="{app}", fp8_proj="{fp8}", tp="1"}}'
            got = prom.query(f"sum({sel})")
            assert got and float(got[0]["value"][1]) > 0, sel
            # The labels of the contract: model/fp8_proj/tp and Serve's application/deployment/replica.
            series = prom.query(sel)
            assert series, sel
            labels = series[0]["metric"]
            assert {"model", "fp8_proj", "tp", "application", "deployment", "replica"} <= set(labels)
            assert labels["model"] == cluster.apps[app].model
            assert labels["deployment"] == "Router"
        # The fp8_proj label splits exactly by app: nothing "on" in the fp8-off app and vice versa.
        for app, fp8 in APPS.items():
            other = {"on": "off", "off": "on"}[fp8]
            assert not prom.query(f'{hist}_count{{application="{app}", fp8_proj="{other}"}}')


def _dashboard_targets() -> list[tuple[str, str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["refId"], t["expr"]) for p in iter_panels(dash)
            for t in p.get("targets", []) if t.get("expr")]


def _finite(result: list[dict]) -> list[float]:
    vals = [float(r["value"][1]) for r in result]
    return [v for v in vals if math.isfinite(v)]


@pytest.mark.parametrize("interval", ["1m", "30s"])
def test_every_dashboard_query_is_accepted_and_returns_data(live, interval):
    prom = live[0]
    targets = _dashboard_targets()
    assert len(targets) >= 30, targets
    titles = {t for t, _, _ in targets}
    assert set(ALLOWED_EMPTY) <= titles, f"stale ALLOWED_EMPTY: {set(ALLOWED_EMPTY) - titles}"
    problems, empty_allowed = [], []
    for title, ref, expr in targets:
        promql = substitute_grafana_vars(expr)
        if interval != "1m":
            promql = substitute_grafana_vars(expr.replace("$__rate_interval", interval))
        assert "$" not in promql, promql
        result = prom.query(promql)     # raises PromQueryError unless status is "success"
        if title in ALLOWED_EMPTY:
            empty_allowed.append((title, ref, len(result)))
            continue
        if not _finite(result):
            problems.append(f"{title}/{ref}: {result}\n    {promql}")
    assert not problems, "queries without finite data:\n" + "\n".join(problems)
    assert len(empty_allowed) >= len(ALLOWED_EMPTY), "the allowed-empty panels were not queried"


def test_dashboard_panels_split_fp8_proj_on_and_off(live):
    """The A/B panels (by model, fp8_proj) show both arms."""
    prom = live[0]
    for title, ref, expr in _dashboard_targets():
        if title in ("Time to first token", "Inter-token latency", "Token throughput"):
            got = {r["metric"].get("fp8_proj") for r in prom.query(substitute_grafana_vars(expr))
                   if math.isfinite(float(r["value"][1]))}
            assert got >= {"on", "off"}, (title, ref, got)


def test_dashboard_variable_queries(live):
    """label_values(metric, label) of the template variables, as Grafana asks Prometheus."""
    prom, cluster, _, _ = live
    dash = json.loads(DASHBOARD.read_text())
    pat = re.compile(r"^label_values\((.+),\s*(\w+)\)$")
    seen = set()
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = pat.match(q.strip())
        assert m, f"{var['name']}: unexpected variable query {q!r}"
        selector, label = substitute_grafana_vars(m.group(1)), m.group(2)
        values = prom.api(f"/api/v1/label/{label}/values", {"match[]": selector})
        seen.add(var["name"])
        if var["name"] == "model":
            assert {cluster.apps[a].model for a in APPS} <= set(values), values
        # $cluster: ray_io_cluster comes from the KubeRay PodMonitors; empty on a local run,
        # and "All" (.*) still matches the series without it (the queries above).
    assert {"cluster", "model"} <= seen


def test_http_panel_sees_the_bad_requests(live):
    """The 400s we sent show up in Ray Serve's HTTP panel (our error panels count engine errors)."""
    prom, serve_cluster = live[0], live[1]
    [expr] = [substitute_grafana_vars(e) for t, _, e in _dashboard_targets() if t == "HTTP requests / s"]
    want = {(app, code) for app in APPS for code in ("200", "400")}
    # NOTE: rate()'s 1-minute window may have passed since the fixture's traffic (earlier tests in this
    # module, a loaded CI box): send a fresh round of 200s and 400s, as the fixture does, until seen.
    clients = _clients(serve_cluster)
    for attempt in range(4):
        _phase(clients, first=False)
        try:
            res = prom.wait_for(expr, timeout=15, predicate=lambda res: want <= {
                (r["metric"].get("application"), r["metric"].get("status_code"))
                for r in res if float(r["value"][1]) > 0})
            break
        except TimeoutError:
            if attempt == 3:
                raise
    assert res


def _our_families(exposition: str, strip_ray_labels: bool = True) -> str:
    """Only the ray_glm_ray_* families (their HELP/TYPE lines and samples)."""
    label_re = re.compile(r'(?:(?<=\{)|(?<=,))(?:%s)="(?:[^"\\]|\\.)*",?' % "|".join(RAY_STANDARD_LABELS))
    keep = []
    for line in exposition.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            if line.split()[2].startswith(OUR_PREFIX):
                keep.append(line)
        elif line.startswith(OUR_PREFIX):
            keep.append(label_re.sub("", line).replace(",}", "}") if strip_ray_labels else line)
    return "\n".join(keep) + "\n"


CAMEL_CASE_FINDING = "label names should be written in 'snake_case' not 'camelCase'"


def test_promtool_check_metrics_on_our_families(live):
    promtool = tool("promtool")
    cluster = live[1]
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=30) as r:
        text = r.read().decode()
    ours = _our_families(text)
    families = {line.split()[2] for line in ours.splitlines() if line.startswith("# TYPE ")}
    # Every family is exported (the counters this traffic never increments exist at 0 from the
    # start), and nothing else carries our prefix.
    expected = {m.exported_name for m in gm.METRICS}
    assert expected <= families, sorted(expected - families)
    assert families <= {m.exported_name for m in gm.METRICS}, sorted(families)
    assert sum(1 for line in ours.splitlines() if not line.startswith("#")) >= 100
    res = run([promtool, "check", "metrics"], input=ours)
    assert res.returncode == 0, f"promtool check metrics rc={res.returncode}:\n{res.stdout}{res.stderr}"
    # Why Ray's standard labels are stripped above: Ray 2.60 adds Component, NodeAddress,
    # SessionName, Version and WorkerId to the gauge series it exports (ours included), and
    # promtool's lint flags those camelCase names (rc 3). They are Ray's, not ours: with them
    # left in, that must be the only finding.
    raw = run([promtool, "check", "metrics"], input=_our_families(text, strip_ray_labels=False))
    findings = {line.split(" ", 1)[1] for line in (raw.stdout + raw.stderr).splitlines() if " " in line}
    assert raw.returncode in (0, 3) and findings <= {CAMEL_CASE_FINDING}, raw.stdout + raw.stderr


#: Recording rules that may evaluate to nothing here: their numerators select error series that
#: light, valid traffic does not create (Ray Serve's; ours exist at 0 from the start).
RULES_ALLOWED_EMPTY = {
    "ray_io_cluster_application:ray_serve_num_http_requests:error_ratio_rate5m":
        "no 5xx answers (our bad requests are 400s)",
}


def test_recording_rules_evaluate_to_data(live):
    prom = live[0]
    # The file we loaded differs from deploy/prometheus/rules.yaml only in the groups' interval.
    records = [r["record"] for g in load_yaml(RULES)["groups"] for r in g["rules"] if "record" in r]
    alerts = [r["alert"] for g in load_yaml(RULES)["groups"] for r in g["rules"] if "alert" in r]
    assert {r["name"] for g in prom.rules() for r in g["rules"]} == set(records) | set(alerts)
    assert set(RULES_ALLOWED_EMPTY) <= set(records), "stale RULES_ALLOWED_EMPTY"

    def finite_labels(res, label):
        return {r["metric"].get(label) for r in res if math.isfinite(float(r["value"][1]))}

    checked = 0
    for name in records:
        if name in RULES_ALLOWED_EMPTY:
            prom.query(name)
            continue
        if name.startswith("ray_io_cluster_model_fp8_proj:"):
            # Per-arm quantiles and rates: both fp8_proj values, as the A/B alerts need.
            res = prom.wait_for(name, timeout=15,
                                predicate=lambda res: finite_labels(res, "fp8_proj") >= {"on", "off"})
        else:
            res = prom.wait_for(name, timeout=15, predicate=lambda res: bool(_finite(res)))
        assert all(v >= 0 for v in _finite(res)), (name, res)
        checked += 1
    assert checked >= 20, checked
    # Every rule, alerts included, evaluated without error.
    health = {(r["name"], r["health"], r.get("lastError", "")) for g in prom.rules() for r in g["rules"]}
    assert all(h == "ok" and not err for _, h, err in health), sorted(health)
