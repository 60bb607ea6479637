"""deploy/prometheus/rules.yaml: promtool-valid, unit-tested, and reading only metrics that exist."""
from __future__ import annotations

import re

import pytest
from deploy_helpers import (
    RAY_SERVE_SERIES,
    RULES,
    RULES_TEST,
    load_yaml,
    promql_metric_names,
    run,
    tool,
)

from glm_ray.serve import metrics as gm

REQUIRED_ALERTS = {"GlmRayTTFTP99High", "GlmRayHighErrorRatio", "GlmRayKVCacheNearFull",
                   "GlmRayNoHealthyRouter"}


@pytest.fixture(scope="module")
def rules() -> list[dict]:
    return [r for g in load_yaml(RULES)["groups"] for r in g["rules"]]


def test_promtool_check_rules():
    promtool = tool("promtool")
    res = run([promtool, "check", "rules", str(RULES)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def test_promtool_test_rules():
    promtool = tool("promtool")
    res = run([promtool, "test", "rules", str(RULES_TEST)], cwd=RULES_TEST.parent)
    assert res.returncode == 0, res.stdout + res.stderr


def test_rule_test_covers_every_alert(rules):
    tested = {t["alertname"] for case in load_yaml(RULES_TEST)["tests"]
              for t in case.get("alert_rule_test", [])}
    alerts = {r["alert"] for r in rules if "alert" in r}
    assert alerts <= tested, f"alerts without a promtool test: {sorted(alerts - tested)}"


def test_required_alerts_and_their_metadata(rules):
    alerts = {r["alert"]: r for r in rules if "alert" in r}
    assert REQUIRED_ALERTS <= set(alerts)
    for name, r in alerts.items():
        assert r["labels"]["severity"] in {"warning", "critical"}, name
        assert r["annotations"].get("summary") and r["annotations"].get("description"), name
        assert re.fullmatch(r"\d+[smh]", r.get("for", "")), f"{name}: give alerts a `for`"


def test_parses_with_promql_parser(rules):
    import promql_parser

    for r in rules:
        promql_parser.parse(r["expr"])


def test_record_names_follow_the_convention(rules):
    for r in rules:
        if "record" in r:
            level, metric, ops = r["record"].split(":")
            assert level and metric and ops, r["record"]
            assert metric.startswith(("ray_glm_ray_", "ray_serve_")), r["record"]


def test_only_known_metrics_are_read(rules):
    recorded = {r["record"] for r in rules if "record" in r}
    allowed = gm.exported_series_names() | RAY_SERVE_SERIES | recorded
    used = set()
    for r in rules:
        used |= promql_metric_names(r["expr"])
    assert used <= allowed, f"unknown metrics: {sorted(used - allowed)}"
    # Alerts read recorded series where one exists (same window as the dashboard's rules).
    assert recorded & used, "alerts should read the recorded series"
