"""Shared helpers of the offline deploy tests: paths, schemas, CRD -> strict JSON Schema, PromQL."""
from __future__ import annotations

import copy
import functools
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VENDORED_SCHEMAS = HERE / "schemas"

DASHBOARD = REPO / "deploy" / "grafana" / "glm-ray.json"
RULES = REPO / "deploy" / "prometheus" / "rules.yaml"
RULES_TEST = REPO / "deploy" / "prometheus" / "rules_test.yaml"
K8S = REPO / "k8s"

DS_VAR = {"type": "prometheus", "uid": "${datasource}"}

#: Ray Serve's own metrics the dashboard and rules may read (names as Prometheus stores them).
RAY_SERVE_SERIES = {
    "ray_serve_num_http_requests_total",
    "ray_serve_http_request_latency_ms_bucket",
    "ray_serve_deployment_processing_latency_ms_bucket",
    "ray_serve_deployment_replica_healthy",
}

try:
    _Loader = yaml.CSafeLoader
except AttributeError:  # pragma: no cover - PyYAML without libyaml
    _Loader = yaml.SafeLoader


def schema_file(rel: str) -> Path:
    """A schema file, from the copies vendored in tests/deploy/schemas (the repository stands alone)."""
    p = VENDORED_SCHEMAS / rel
    assert p.is_file(), f"schema {rel} is not vendored in {VENDORED_SCHEMAS}"
    return p


def load_yaml(path: Path) -> Any:
    return yaml.load(path.read_text(), Loader=_Loader)


def load_yaml_docs(text: str) -> list[dict]:
    return [d for d in yaml.load_all(text, Loader=_Loader) if d is not None]


def load_module(name: str, path: Path):
    """Import a file as a module (tools/*.py are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------ CRD -> JSON Schema

def strict_openapi(schema: dict) -> dict:
    """Kubernetes structural OpenAPI v3 -> draft-07 JSON Schema as strict as the API server.

    - objects with `properties` reject unknown fields (what `kubectl --validate=strict` does),
      unless marked `x-kubernetes-preserve-unknown-fields` or carrying `additionalProperties`;
    - `x-kubernetes-int-or-string` accepts an integer or a string;
    - `nullable: true` also accepts null.
    CEL rules (`x-kubernetes-validations`) are not evaluated: assert such things in tests.
    """
    s = copy.deepcopy(schema)

    def walk(n: Any) -> None:
        if isinstance(n, dict):
            if n.get("x-kubernetes-int-or-string"):
                n.pop("type", None)
                n.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
            if n.get("nullable") and isinstance(n.get("type"), str):
                n["type"] = [n["type"], "null"]
            if (n.get("type") == "object" and "properties" in n
                    and not n.get("x-kubernetes-preserve-unknown-fields")
                    and "additionalProperties" not in n):
                n["additionalProperties"] = False
            for v in n.values():
                walk(v)
        elif isinstance(n, list):
            for v in n:
                walk(v)

    walk(s)
    return s


@functools.lru_cache(maxsize=None)
def crd_validators(rel: str) -> dict[tuple[str, str], Any]:
    """{(apiVersion, kind): Draft7Validator} for every served version of one CRD file."""
    import jsonschema

    crd = load_yaml(schema_file(rel))
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    out = {}
    for v in crd["spec"]["versions"]:
        # No check_schema(): some CRD patterns use Go regex syntax (e.g. "^(?i)...") that
        # Python's `re` rejects; they only matter when the field is present.
        schema = strict_openapi(v["schema"]["openAPIV3Schema"])
        out[(f"{group}/{v['name']}", kind)] = jsonschema.Draft7Validator(schema)
    return out


CRD_FILES = {
    "RayService": "kuberay/ray.io_rayservices.yaml",
    "PodMonitor": "prometheus-operator/monitoring.coreos.com_podmonitors.yaml",
    "PrometheusRule": "prometheus-operator/monitoring.coreos.com_prometheusrules.yaml",
}


def crd_errors(doc: dict) -> list[str]:
    """Strict schema errors of one custom resource (KeyError if its kind is not vendored)."""
    validators = crd_validators(CRD_FILES[doc["kind"]])
    key = (doc["apiVersion"], doc["kind"])
    if key not in validators:
        return [f"{key} is not a served version of the CRD ({sorted(validators)})"]
    return [f"{'/'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
            for e in sorted(validators[key].iter_errors(doc), key=lambda e: [str(p) for p in e.path])]


# ------------------------------------------------------------------------ Grafana / PromQL

GRAFANA_BUILTIN = re.compile(r"\$__\w+|\$\{__\w+\}")
VAR_REF = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")


def grafana_var_refs(text: str) -> set[str]:
    """Names of the template variables a string refers to ($x, ${x}, ${x:fmt}, [[x]])."""
    text = GRAFANA_BUILTIN.sub("", text)
    return {a or b or c for a, b, c in VAR_REF.findall(text)}


def substitute_grafana_vars(expr: str) -> str:
    """Make a panel query plain PromQL: intervals become durations, variables match all."""
    expr = re.sub(r"\$__rate_interval|\$\{__rate_interval\}", "1m", expr)
    expr = re.sub(r"\$__interval|\$\{__interval\}|\$interval", "30s", expr)
    expr = re.sub(r"\$__range|\$\{__range\}", "5m", expr)
    return VAR_REF.sub(".*", expr)


def iter_panels(dashboard: dict) -> Iterator[dict]:
    for p in dashboard.get("panels", []):
        yield p
        yield from p.get("panels", []) if p.get("type") == "row" else ()


def iter_strings(obj: Any) -> Iterator[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield str(k)
            yield from iter_strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from iter_strings(v)


def promql_selectors(expr: str) -> list[Any]:
    """Every VectorSelector in a PromQL expression (promql_parser AST)."""
    import promql_parser

    found = []

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def selector_name(sel: Any) -> str | None:
    if sel.name:
        return sel.name
    for m in sel.matchers.matchers:
        if m.name == "__name__":
            return m.value
    return None


def promql_metric_names(expr: str) -> set[str]:
    return {n for n in (selector_name(s) for s in promql_selectors(expr)) if n}


def histogram_quantiles(expr: str) -> set[tuple[float, str]]:
    """(quantile, histogram metric without _bucket) for each histogram_quantile() call."""
    import promql_parser

    out: set[tuple[float, str]] = set()

    def visit(node):
        if isinstance(node, promql_parser.Call) and node.func.name == "histogram_quantile":
            q = node.args[0]
            if isinstance(q, promql_parser.NumberLiteral):
                for name in promql_metric_names(node.args[1].prettify()):
                    out.add((float(q.val), name.removesuffix("_bucket")))
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return out


# ------------------------------------------------------------------------ external tools

_INSTALL_HINTS = {
    "promtool": "apt-get install -y --no-install-recommends prometheus",
    "prometheus": "apt-get install -y --no-install-recommends prometheus",
    "kubectl": "any kubectl >= 1.27 on PATH; `kubectl kustomize` works offline",
}


def tool(name: str) -> str:
    """Path of an external tool, or skip the test saying how to get it."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not found on PATH ({_INSTALL_HINTS.get(name, 'install it')})")
    return path


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


@functools.lru_cache(maxsize=None)
def kustomize(path: str) -> str:
    kubectl = tool("kubectl")
    res = run([kubectl, "kustomize", path])
    assert res.returncode == 0, f"kubectl kustomize {path} failed:\n{res.stderr}"
    return res.stdout
