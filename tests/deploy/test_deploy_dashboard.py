"""deploy/grafana/glm-ray.json: generated, schema-valid, well laid out, and its queries are sound."""
from __future__ import annotations

import json

import pytest
from deploy_helpers import (
    DASHBOARD,
    DS_VAR,
    RAY_SERVE_SERIES,
    REPO,
    RULES,
    grafana_var_refs,
    histogram_quantiles,
    iter_panels,
    iter_strings,
    load_module,
    load_yaml,
    promql_selectors,
    run,
    schema_file,
    selector_name,
    substitute_grafana_vars,
    tool,
)

from glm_ray.serve import metrics as gm


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def targets(dashboard) -> list[tuple[dict, dict]]:
    return [(p, t) for p in iter_panels(dashboard) for t in p.get("targets", [])]


def test_committed_json_is_the_generator_output():
    gen = load_module("build_dashboard", REPO / "tools" / "build_dashboard.py")
    assert DASHBOARD.read_text() == gen.render(), \
        "deploy/grafana/glm-ray.json is stale: run python tools/build_dashboard.py"


def test_validates_against_the_grafana_schema(dashboard):
    import jsonschema

    schema = json.loads(schema_file("grafana/dashboard.schema.json").read_text())
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(dashboard),
                    key=lambda e: [str(p) for p in e.absolute_path])
    assert not errors, "\n".join(
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:20])


def test_modern_format_basics(dashboard):
    assert dashboard["uid"] and dashboard["title"]
    assert dashboard["schemaVersion"] >= 36
    assert "rows" not in dashboard
    for panel in iter_panels(dashboard):
        if panel["type"] != "row":
            assert panel.get("datasource") == DS_VAR, panel["title"]
            assert panel.get("title")
    assert all(isinstance(p.get("datasource", {}), dict) for p in iter_panels(dashboard))


def test_panel_ids_unique(dashboard):
    ids = [p["id"] for p in iter_panels(dashboard)]
    assert len(ids) == len(set(ids)), ids
    assert all(isinstance(i, int) and i > 0 for i in ids)


def test_grid_positions_sane_and_non_overlapping(dashboard):
    cells: dict[tuple[int, int], str] = {}
    for p in iter_panels(dashboard):
        g = p["gridPos"]
        for k in ("x", "y", "w", "h"):
            assert isinstance(g[k], int) and not isinstance(g[k], bool), (p["title"], g)
        assert g["w"] >= 1 and g["h"] >= 1 and g["x"] >= 0 and g["y"] >= 0
        assert g["x"] + g["w"] <= 24, (p["title"], g)
        if p["type"] == "row":
            assert (g["x"], g["w"], g["h"]) == (0, 24, 1)
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r} at {(x, y)}"
                cells[(x, y)] = p["title"]


def test_every_variable_used_is_defined(dashboard):
    defined = [v["name"] for v in dashboard["templating"]["list"]]
    assert len(defined) == len(set(defined))
    used = set()
    for s in iter_strings({k: v for k, v in dashboard.items()}):
        used |= grafana_var_refs(s)
    missing = used - set(defined)
    assert not missing, f"undefined variables: {sorted(missing)}"
    assert {"datasource", "cluster", "model", "fp8_proj"} <= set(defined)


def test_variables(dashboard):
    v = {x["name"]: x for x in dashboard["templating"]["list"]}
    assert v["datasource"]["type"] == "datasource" and v["datasource"]["query"] == "prometheus"
    assert "ray_io_cluster" in v["cluster"]["query"]["query"]
    assert "model" in v["model"]["query"]["query"]
    assert {o["value"] for o in v["fp8_proj"]["options"]} >= {"on", "off"}
    for name in ("cluster", "model", "fp8_proj"):
        assert v[name]["includeAll"] and v[name]["allValue"] == ".*", \
            "'All' must also match series without the label (local runs have no ray_io_cluster)"
        if v[name]["type"] == "query":
            assert v[name]["datasource"] == DS_VAR


def test_targets_have_refid_and_the_datasource_variable(dashboard):
    for panel in iter_panels(dashboard):
        if panel["type"] == "row":
            continue
        tgts = panel.get("targets", [])
        assert tgts, f"{panel['title']} has no query"
        refs = [t.get("refId") for t in tgts]
        assert all(refs) and len(refs) == len(set(refs)), (panel["title"], refs)
        for t in tgts:
            assert t.get("datasource") == DS_VAR, (panel["title"], t.get("datasource"))
            assert t.get("expr"), panel["title"]


def test_every_expr_parses(targets):
    import promql_parser

    for panel, t in targets:
        expr = substitute_grafana_vars(t["expr"])
        assert "$" not in expr, expr
        try:
            promql_parser.parse(expr)
        except ValueError as e:
            pytest.fail(f"{panel['title']}/{t['refId']}: {e}\n{expr}")


def test_metric_names_are_ours_or_ray_serves(targets):
    allowed = gm.exported_series_names() | RAY_SERVE_SERIES
    used = set()
    for panel, t in targets:
        for sel in promql_selectors(substitute_grafana_vars(t["expr"])):
            name = selector_name(sel)
            assert name, f"{panel['title']}: selector without a metric name"
            used.add(name)
    assert used <= allowed, f"unknown metrics: {sorted(used - allowed)}"
    assert RAY_SERVE_SERIES <= used, f"Ray Serve panels missing: {sorted(RAY_SERVE_SERIES - used)}"
    ours = {s.series_names[0] for s in gm.METRICS}   # _bucket, _total or the gauge itself
    assert ours <= used, f"metrics without a panel: {sorted(ours - used)}"


def test_selectors_carry_the_dashboard_filters(targets):
    for panel, t in targets:
        for sel in promql_selectors(t["expr"].replace("$__rate_interval", "1m")):
            matchers = {m.name: m.value for m in sel.matchers.matchers}
            assert matchers.get("ray_io_cluster") == "$cluster", (panel["title"], str(sel))
            if selector_name(sel).startswith("ray_glm_ray_"):
                assert matchers.get("model") == "$model", (panel["title"], str(sel))
                assert matchers.get("fp8_proj") == "$fp8_proj", (panel["title"], str(sel))


def test_grouping_labels_exist_on_the_metrics(targets):
    import promql_parser

    engine_labels = set(gm.LABEL_KEYS) | set(gm.SERVE_TAG_KEYS) | {"ray_io_cluster", "le"}
    engine_labels |= {k for s in gm.METRICS for k in s.extra_tag_keys}
    serve_labels = {"ray_io_cluster", "application", "deployment", "replica", "route", "method",
                    "status_code", "le"}
    for panel, t in targets:
        expr = substitute_grafana_vars(t["expr"])
        names = {selector_name(s) for s in promql_selectors(expr)}
        labels = engine_labels if all(n.startswith("ray_glm_ray_") for n in names) else serve_labels
        found = []

        def visit(node):
            if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
                found.extend(node.modifier.labels)
            return True

        promql_parser.walk(promql_parser.parse(expr), visit)
        assert set(found) <= labels, (panel["title"], sorted(set(found) - labels))


def test_ttft_and_itl_are_split_by_fp8_proj(dashboard):
    want = {"ray_glm_ray_time_to_first_token_seconds", "ray_glm_ray_inter_token_latency_seconds"}
    seen: dict[str, set[float]] = {m: set() for m in want}
    for panel in iter_panels(dashboard):
        for t in panel.get("targets", []):
            expr = substitute_grafana_vars(t["expr"])
            for q, metric in histogram_quantiles(expr):
                if metric in want and "fp8_proj" in expr.split("by (", 1)[-1].split(")")[0]:
                    seen[metric].add(q)
                    assert "fp8_proj" in t["legendFormat"], panel["title"]
    for metric, qs in seen.items():
        assert qs >= {0.5, 0.9, 0.99}, (metric, qs)


def test_required_panels_present(dashboard):
    titles = {p["title"] for p in iter_panels(dashboard)}
    for needle in ("Time to first token", "Inter-token latency", "Time per output token",
                   "End-to-end request latency", "Token throughput", "Errors by type",
                   "Running and waiting requests", "KV cache usage", "Decode batch size",
                   "Prefill batch tokens", "HTTP requests / s", "HTTP request latency",
                   "Deployment processing latency", "Healthy replicas"):
        assert needle in titles, needle


def test_every_dashboard_quantile_has_a_recording_rule(targets):
    rules = load_yaml(RULES)
    recorded = set()
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                recorded |= histogram_quantiles(rule["expr"])
    shown = set()
    for _, t in targets:
        shown |= histogram_quantiles(substitute_grafana_vars(t["expr"]))
    missing = shown - recorded
    assert not missing, f"quantiles on the dashboard without a recording rule: {sorted(missing)}"


def test_promtool_parses_every_dashboard_query(targets, tmp_path):
    """Prometheus' own parser, via a throw-away rule file of all panel queries."""
    import yaml

    promtool = tool("promtool")
    rules = [{"record": f"dashboard:query_{i}:check", "expr": substitute_grafana_vars(t["expr"])}
             for i, (_, t) in enumerate(targets)]
    f = tmp_path / "dashboard_queries.yaml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    res = run([promtool, "check", "rules", str(f)])
    assert res.returncode == 0, res.stdout + res.stderr
