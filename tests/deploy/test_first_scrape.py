"""Metrics from the first scrape: every `ray_glm_ray_*` series the Grafana dashboard and the Prometheus
rules query exists, at 0, in the first scrape of a fresh Prometheus, for an app that has served nothing.

The app is the session cluster's "firstscrape" (tests/conftest.py), which no other test sends a
request to. A new Prometheus (tests/deploy/promserver.py) scrapes Ray's metrics export port; right
after its first successful scrape (`up == 1`) the queries below run. The metric names come from the
dashboard's panel and variable queries and the rules' expressions (parsed with promql_parser), so a
new panel on a new series is covered without editing this file. The oracle for the label sets is the
contract in glm_ray/serve/metrics.py (finish reasons, the Router's error types, model/fp8_proj/tp).

What cannot exist before traffic, and is therefore left out:
- our histograms' `_bucket`/`_count`/`_sum`: Ray 2.60's metrics agent drops histogram points with
  a count of 0 (glm_ray/serve/metrics.py, "Series from the first scrape"); they appear with the
  first observation, and their quantile panels have nothing to show before it anyway;
- Ray Serve's own `ray_serve_*` series (HTTP requests, latencies): Ray Serve's to export;
- the recording rules' outputs (`level:metric:operations` names): Prometheus computes them.

Then one request: the zero series is what lets `increase()` see the first increment (a series that
appears at 1 has no earlier sample to count from).
"""
from __future__ import annotations

import json
import shutil

import pytest
from deploy_helpers import DASHBOARD, RULES, iter_panels, load_yaml, promql_metric_names, substitute_grafana_vars
from promserver import PromServer

from glm_ray.serve import metrics as gm

APP = "firstscrape"
JOB = "ray"
OUR_PREFIX = gm.RAY_EXPORT_PREFIX + gm.METRIC_PREFIX          # "ray_glm_ray_"
SPEC_OF_SERIES = {name: spec for spec in gm.METRICS for name in spec.series_names}


def queried_names() -> set[str]:
    """Every metric name in the dashboard's queries (panels and variables) and the rules' expressions."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in iter_panels(dash) for t in p.get("targets", []) if t.get("expr")]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            exprs.append(q.strip().removeprefix("label_values(").rsplit(",", 1)[0])   # its series selector
    exprs += [r["expr"] for g in load_yaml(RULES)["groups"] for r in g["rules"]]
    return {n for e in exprs for n in promql_metric_names(substitute_grafana_vars(e))}


@pytest.fixture(scope="module")
def first_scrape(request, tmp_path_factory):
    if shutil.which("prometheus") is None:      # checked before the (slow) cluster start
        pytest.skip("prometheus binary not found on PATH "
                    "(apt-get install -y --no-install-recommends prometheus)")
    cluster = request.getfixturevalue("serve_cluster")
    prom = PromServer([f"127.0.0.1:{cluster.metrics_port}"], job=JOB,
                      workdir=tmp_path_factory.mktemp("first-scrape") / "prom")
    prom.start()
    try:
        prom.wait_for(f'up{{job="{JOB}"}} == 1', timeout=30)      # the first scrape is in
        yield prom, cluster.apps[APP]
    finally:
        prom.stop()


def test_every_queried_series_of_ours_exists_at_zero_before_traffic(first_scrape):
    prom, app = first_scrape
    names = queried_names()
    ours = {n for n in names if n.startswith(OUR_PREFIX)}
    assert ours, names
    unknown = ours - set(SPEC_OF_SERIES)
    assert not unknown, f"the dashboard/rules query series glm_ray/serve/metrics.py does not define: {unknown}"
    checked = {n for n in ours if SPEC_OF_SERIES[n].kind != "histogram"}
    assert {SPEC_OF_SERIES[n] for n in checked} >= {gm.REQUEST_ERRORS, gm.REQUESTS_FINISHED, gm.REQUESTS_RUNNING,
                                                   gm.KV_CACHE_USAGE}, sorted(checked)
    labels = {"model": app.model, "fp8_proj": "off", "tp": "1", "application": APP, "deployment": "Router"}
    missing, nonzero = [], []
    for name in sorted(checked):
        spec = SPEC_OF_SERIES[name]
        series = prom.query(f'{name}{{application="{APP}"}}')
        if not series:
            missing.append(name)
            continue
        nonzero += [(name, s["metric"], s["value"][1]) for s in series if float(s["value"][1]) != 0.0]
        for s in series:
            assert labels.items() <= s["metric"].items(), (name, s["metric"])
        if spec is gm.REQUESTS_FINISHED:
            assert {s["metric"]["finish_reason"] for s in series} == set(gm.FINISH_REASONS), series
        if spec is gm.REQUEST_ERRORS:
            assert {s["metric"]["error_type"] for s in series} == {
                "server_overloaded", "engine_error", "out_of_memory", "engine_dead"}, series
    assert not missing, f"no series in the first scrape (before any traffic) for: {missing}"
    assert not nonzero, f"an app that served nothing reports: {nonzero}"
    # ... and every counter and gauge we define is there, queried or not
    for spec in gm.METRICS:
        if spec.kind != "histogram":
            assert prom.query(f'{spec.exported_name}{{application="{APP}"}}'), spec.exported_name
    # the dashboard's $model variable lists the app before its first request
    values = prom.api("/api/v1/label/model/values", {"match[]": gm.REQUESTS_RUNNING.exported_name})
    assert app.model in values, values


def test_increase_sees_the_first_request(first_scrape):
    import openai

    prom, app = first_scrape
    client = openai.OpenAI(base_url=app.base_url + "/v1", api_key="EMPTY", max_retries=0, timeout=120)
    r = client.completions.create(model=app.model, prompt="first", max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    sel = f'{gm.REQUESTS_FINISHED.exported_name}{{application="{APP}", finish_reason="length"}}'
    # Ray exports every metrics_report_interval_ms (10 s by default for `ray start`), Prometheus scrapes each second
    res = prom.wait_for(f"increase({sel}[5m])", timeout=90, predicate=lambda res: any(
        float(x["value"][1]) > 0 for x in res))
    assert res
    assert float(prom.query(f"sum({sel})")[0]["value"][1]) == 1.0
