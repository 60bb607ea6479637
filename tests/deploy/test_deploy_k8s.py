"""k8s/: strict schema validation of every object, the RayService's contracts, kustomize renders.

Custom resources are validated against the vendored CRDs made strict (unknown fields fail);
built-in kinds with kubernetes-validate --strict; serveConfigV2 with Ray Serve's own schema plus
an unknown-key check (serve_schema.py). What the schemas leave open (upgradeStrategy.type,
GPU counts vs TP vs HIP_VISIBLE_DEVICES, the args of build_app) is asserted here.
"""
from __future__ import annotations

import copy
import re

import pytest
import yaml
from deploy_helpers import (
    CRD_FILES,
    DASHBOARD,
    K8S,
    REPO,
    RULES,
    crd_errors,
    kustomize,
    load_module,
    load_yaml,
    load_yaml_docs,
    run,
    tool,
)
from serve_schema import validate_serve_config

BASE = K8S / "base"
OVERLAY = K8S / "overlays" / "h200"
GEN = load_module("gen_k8s", REPO / "tools" / "gen_k8s.py")

# The args of glm_ray.serve.app:build_app (fixed by the project) and their allowed values.
APP_ARGS = {
    "model": str, "served_model_name": str, "tp": int, "device": ("auto", "cpu", "cuda"),
    "dtype": ("auto", "bfloat16", "float32"), "load_format": ("auto", "dummy"),
    "fp8_proj_gemm": bool, "fp8_proj_min_tokens": int,
    "kernel_backend": ("auto", "torch", "cuda", "aiter"), "max_num_seqs": int,
    "max_num_batched_tokens": int, "max_model_len": int, "block_size": int,
    "gpu_memory_utilization": float, "max_queued_requests": int,
    "accelerator_type": str, "router_cpus": (int, float), "ingress_replicas": int,
    "kv_cache_memory_gb": (int, float), "request_router": ("prefix_affinity", "power_of_two"),
    "prefix_affinity_min_match": (int, float), "prefix_affinity_max_imbalance": int,
    "prefix_affinity_max_tokens": int,
}
UPGRADE_TYPES = {"NewCluster", "NewClusterWithIncrementalUpgrade", "None"}
MI355X = "accelerator_type:AMD-Instinct-MI355X-OAM"
H200 = "accelerator_type:H200"


# ------------------------------------------------------------------------------- fixtures

def _source_docs() -> list[dict]:
    docs = []
    for path in sorted(BASE.rglob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs.extend(load_yaml_docs(path.read_text()))
    return docs


@pytest.fixture(scope="module")
def source_docs() -> list[dict]:
    return _source_docs()


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    return load_yaml_docs(kustomize(str(K8S)))


@pytest.fixture(scope="module")
def rendered_h200() -> list[dict]:
    return load_yaml_docs(kustomize(str(OVERLAY)))


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def serve_config(rs: dict) -> dict:
    return yaml.safe_load(rs["spec"]["serveConfigV2"])


def worker_group(rs: dict) -> dict:
    groups = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert len(groups) == 1
    return groups[0]


def container(template: dict) -> dict:
    cs = template["spec"]["containers"]
    assert len(cs) == 1
    return cs[0]


def env_of(c: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in c.get("env", [])}


# ------------------------------------------------------------------------------- rendering

EXPECTED_KINDS = sorted(["Namespace", "PersistentVolumeClaim", "RayService", "PodMonitor",
                         "PodMonitor", "ConfigMap", "PrometheusRule"])


def test_kustomize_renders_base(rendered):
    assert sorted(d["kind"] for d in rendered) == EXPECTED_KINDS
    assert all(d["metadata"].get("namespace") == "glm-ray" for d in rendered
               if d["kind"] != "Namespace")


def test_kustomize_renders_h200_overlay(rendered_h200):
    assert sorted(d["kind"] for d in rendered_h200) == EXPECTED_KINDS


def test_source_files_hold_the_same_objects(source_docs):
    assert sorted(d["kind"] for d in source_docs) == EXPECTED_KINDS
    listed = load_yaml(BASE / "kustomization.yaml")["resources"]
    on_disk = sorted(str(p.relative_to(BASE)) for p in BASE.rglob("*.yaml")
                     if p.name != "kustomization.yaml")
    assert sorted(listed) == on_disk, "every manifest in k8s/base is listed in its kustomization"


def test_no_service_monitor(source_docs):
    assert not [d for d in source_docs if d["kind"] == "ServiceMonitor"], \
        "scrape Ray pods with PodMonitors (a ServiceMonitor double-counts the head)"


# ------------------------------------------------------------------------------- schemas

def _crs(docs):
    return [d for d in docs if d["kind"] in CRD_FILES]


@pytest.mark.parametrize("which", ["source", "rendered", "rendered_h200"])
def test_custom_resources_validate_strictly(which, request):
    docs = _source_docs() if which == "source" else request.getfixturevalue(which)
    crs = _crs(docs)
    assert {d["kind"] for d in crs} == set(CRD_FILES)
    for d in crs:
        errs = crd_errors(d)
        assert not errs, f"{d['kind']}/{d['metadata']['name']}:\n" + "\n".join(errs[:20])


def test_strict_crd_validation_catches_mistakes(source_docs):
    rs = copy.deepcopy(one(source_docs, "RayService"))
    wg = worker_group(rs)
    wg["numOfHost"] = 1                                      # typo of numOfHosts
    wg["replicas"] = "one"
    container(wg["template"])["imagePullPolicy2"] = "Always"
    rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"][0][
        "containerPort"] = "x"
    errs = "\n".join(crd_errors(rs))
    for needle in ("numOfHost", "'one' is not of type 'integer'", "imagePullPolicy2",
                   "'x' is not of type 'integer'"):
        assert needle in errs, (needle, errs)
    pm = copy.deepcopy(one_named(source_docs, "PodMonitor", "glm-ray-head"))
    pm["spec"]["podMetricsEndpoints"][0]["relabelings"][0]["target_label"] = "x"
    assert any("target_label" in e for e in crd_errors(pm))


def one_named(docs, kind, name):
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name)
    return found[0]


def _kv_validate(doc: dict) -> None:
    import kubernetes_validate as kv

    try:
        kv.validate(doc, kv.latest_version(), strict=True)
    except kv.ValidationError as e:
        pytest.fail(f"{doc['kind']}/{doc.get('metadata', {}).get('name')}: "
                    f"{str(e).splitlines()[0]}")


def test_builtin_kinds_validate_with_kubernetes_validate(source_docs):
    builtins = [d for d in source_docs if d["kind"] not in CRD_FILES]
    assert {d["kind"] for d in builtins} == {"Namespace", "PersistentVolumeClaim", "ConfigMap"}
    for d in builtins:
        _kv_validate(d)


@pytest.mark.parametrize("overlay", [False, True])
def test_pod_templates_validate_as_core_pod_templates(overlay, source_docs, request):
    docs = request.getfixturevalue("rendered_h200") if overlay else source_docs
    rs = one(docs, "RayService")
    rcc = rs["spec"]["rayClusterConfig"]
    for name, tmpl in [("head", rcc["headGroupSpec"]["template"])] + [
            (g["groupName"], g["template"]) for g in rcc["workerGroupSpecs"]]:
        _kv_validate({"apiVersion": "v1", "kind": "PodTemplate",
                      "metadata": {"name": name}, "template": tmpl})


def test_kubernetes_validate_cli_strict(tmp_path, source_docs):
    """The CLI on the built-in kinds (it only warns about CRDs it has no schema for)."""
    import shutil

    cli = shutil.which("kubernetes-validate")
    if cli is None:
        pytest.skip("kubernetes-validate CLI not on PATH (the Python API test covers it)")
    f = tmp_path / "builtins.yaml"
    f.write_text(yaml.safe_dump_all([d for d in source_docs if d["kind"] not in CRD_FILES]))
    res = run([cli, "--strict", str(f)])
    assert res.returncode == 0, res.stdout + res.stderr


# ------------------------------------------------------------------------------- RayService

def test_rayservice_lifecycle_settings(source_docs):
    spec = one(source_docs, "RayService")["spec"]
    assert spec["upgradeStrategy"]["type"] in UPGRADE_TYPES     # the CRD has no enum for it
    assert spec["upgradeStrategy"]["type"] == "NewCluster"
    assert "clusterUpgradeOptions" not in spec["upgradeStrategy"], "only for incremental upgrades"
    for deprecated in ("serviceUnhealthySecondThreshold", "deploymentUnhealthySecondThreshold"):
        assert deprecated not in spec, f"{deprecated} is ignored by KubeRay"
    assert spec["rayClusterDeletionDelaySeconds"] >= 60
    assert spec["excludeHeadPodFromServeSvc"] is True


def test_ray_version_matches_the_project():
    pin = re.search(r'"ray(\[[^\]]*\])?\s*==\s*(\d+\.\d+)[^"]*"',
                    (REPO / "pyproject.toml").read_text())
    assert pin, "pyproject.toml pins ray"
    major_minor = pin.group(2)
    rs = one(_source_docs(), "RayService")
    assert rs["spec"]["rayClusterConfig"]["rayVersion"].startswith(major_minor + "."), pin


def test_head_pod(source_docs):
    head = one(source_docs, "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0", "no replicas on the head"
    c = container(head["template"])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["metrics"] == 8080 and ports["serve"] == 8000 and ports["gcs"] == 6379
    assert not {"HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"} & set(env_of(c))
    assert not any("gpu" in k for k in c["resources"]["limits"])


def _check_worker(rs: dict, gpu_key: str, accel: str) -> dict:
    wg = worker_group(rs)
    c = container(wg["template"])
    limits, requests = c["resources"]["limits"], c["resources"]["requests"]
    gpus = int(limits[gpu_key])
    assert int(requests[gpu_key]) == gpus == 8
    assert [k for k in limits if k.endswith("gpu")] == [gpu_key]
    assert wg["resources"] == {accel: "1"}, "the Ray resource the GPU bundles ask for"
    assert wg["minReplicas"] <= wg["replicas"] <= wg["maxReplicas"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["metrics"] == 8080
    # /dev/shm: a memory-backed emptyDir.
    vols = {v["name"]: v for v in wg["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert vols[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
    # The model volume: the PVC, read-only.
    models = mounts["/models"]
    assert models.get("readOnly") is True
    assert vols[models["name"]]["persistentVolumeClaim"]["claimName"] == "glm-models"
    env = env_of(c)
    assert "ROCR_VISIBLE_DEVICES" not in env, "Ray refuses ROCR_VISIBLE_DEVICES without HIP_..."
    assert "CUDA_VISIBLE_DEVICES" not in env, "Ray masks GPUs per actor itself"
    return {"gpus": gpus, "env": env, "tolerations": wg["template"]["spec"].get("tolerations", [])}


def _check_serve_config(rs: dict, gpus: int, accel: str, backend: str) -> dict:
    cfg = serve_config(rs)
    validate_serve_config(cfg)
    (app,) = cfg["applications"]
    assert app["import_path"] == "glm_ray.serve.app:build_app"
    args = app["args"]
    assert set(args) <= set(APP_ARGS), f"unknown build_app args: {set(args) - set(APP_ARGS)}"
    for k, v in args.items():
        want = APP_ARGS[k]
        if isinstance(want, tuple) and all(isinstance(w, str) for w in want):
            assert v in want, (k, v)
        elif want is bool:
            assert isinstance(v, bool), (k, v)
        else:
            assert isinstance(v, want) and not isinstance(v, bool), (k, v)
    try:   # the app's own parser, when it is importable (it is light: a dataclass)
        from glm_ray.serve.args import ServeArgs
    except ImportError:
        ServeArgs = None
    if ServeArgs is not None:
        ServeArgs.from_dict(args)
    assert args["accelerator_type"] == accel.split(":", 1)[1]
    assert args["tp"] == gpus == 8, "one Router replica = one TP group = one whole node"
    assert args["fp8_proj_gemm"] is True
    assert args["kernel_backend"] == backend
    assert args["model"].startswith("/models/")
    assert 0 < args["gpu_memory_utilization"] < 1
    assert args["max_num_batched_tokens"] >= args["fp8_proj_min_tokens"]

    deps = {d["name"]: d for d in app["deployments"]}
    assert set(deps) == {"OpenAIIngress", "Router"}
    router = deps["Router"]
    assert router["placement_group_strategy"] == "STRICT_PACK"
    bundles = router["placement_group_bundles"]
    assert bundles[0] == {"CPU": args["router_cpus"]}
    # What the app builds itself for accelerator_type (glm_ray/serve/router.py), one per rank.
    assert bundles[1:] == [{"CPU": 1, "GPU": 1, accel: 0.001}] * args["tp"]
    assert router["ray_actor_options"].get("num_gpus", 0) == 0
    assert router["ray_actor_options"]["num_cpus"] == args["router_cpus"] <= bundles[0]["CPU"]
    assert router["graceful_shutdown_timeout_s"] >= 300, "let long generations finish"
    assert router["max_ongoing_requests"] >= args["max_num_seqs"]
    for d in deps.values():
        if "autoscaling_config" in d:
            # "auto" replaces the num_replicas that build_app sets in code.
            assert d.get("num_replicas") == "auto", d["name"]
    return cfg


def test_mi355x_worker_and_serve_config(source_docs):
    rs = one(source_docs, "RayService")
    w = _check_worker(rs, "amd.com/gpu", MI355X)
    hip = w["env"]["HIP_VISIBLE_DEVICES"].split(",")
    assert hip == [str(i) for i in range(w["gpus"])], "one HIP device per amd.com/gpu"
    assert {"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in w["tolerations"]
    _check_serve_config(rs, w["gpus"], MI355X, "aiter")


def test_h200_overlay(rendered_h200):
    rs = one(rendered_h200, "RayService")
    w = _check_worker(rs, "nvidia.com/gpu", H200)
    assert "HIP_VISIBLE_DEVICES" not in w["env"]
    assert "amd.com/gpu" not in yaml.safe_dump(rs)
    assert MI355X not in yaml.safe_dump(rs)
    for c in (container(worker_group(rs)["template"]),
              container(rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"])):
        assert c["image"].endswith("-cuda"), c["image"]
    _check_serve_config(rs, w["gpus"], H200, "cuda")


def test_h200_serve_config_only_differs_where_it_must(source_docs, rendered_h200):
    def normalize(cfg: dict) -> dict:
        cfg = copy.deepcopy(cfg)
        app = cfg["applications"][0]
        for k in ("kernel_backend", "gpu_memory_utilization", "accelerator_type"):
            app["args"].pop(k)
        for d in app["deployments"]:
            for b in d.get("placement_group_bundles", []):
                for k in [k for k in b if k.startswith("accelerator_type:")]:
                    b.pop(k)
        return cfg

    base = serve_config(one(source_docs, "RayService"))
    h200 = serve_config(one(rendered_h200, "RayService"))
    assert normalize(base) == normalize(h200), "keep overlays/h200's serveConfigV2 in step"


def test_pvc_backs_the_model_volume(source_docs):
    pvc = one(source_docs, "PersistentVolumeClaim")
    assert pvc["metadata"]["name"] == "glm-models"
    assert set(pvc["spec"]["accessModes"]) & {"ReadWriteMany", "ReadOnlyMany"}, \
        "every Ray pod on every node mounts it"


# ------------------------------------------------------------------------------- monitoring

def test_pod_monitors(source_docs):
    rs = one(source_docs, "RayService")
    rcc = rs["spec"]["rayClusterConfig"]
    pod_labels = {
        "head": rcc["headGroupSpec"]["template"]["metadata"]["labels"],
        "worker": worker_group(rs)["template"]["metadata"]["labels"],
    }
    pms = [d for d in source_docs if d["kind"] == "PodMonitor"]
    assert len(pms) == 2
    seen = set()
    for pm in pms:
        sel = dict(pm["spec"]["selector"]["matchLabels"])
        node_type = sel.pop("ray.io/node-type")              # set by KubeRay on its pods
        seen.add(node_type)
        assert sel and sel.items() <= pod_labels[node_type].items(), (sel, pod_labels[node_type])
        (ep,) = pm["spec"]["podMetricsEndpoints"]
        assert ep["port"] == "metrics"
        assert {"action": "replace", "sourceLabels": ["__meta_kubernetes_pod_label_ray_io_cluster"],
                "targetLabel": "ray_io_cluster"} in ep["relabelings"]
        assert pm["metadata"]["labels"].get("release") == "prometheus"
    assert seen == {"head", "worker"}


def test_generated_files_are_fresh():
    for path, text in GEN.outputs().items():
        assert path.exists(), f"{path} missing: run python tools/gen_k8s.py"
        assert path.read_text() == text, f"{path} is stale: run python tools/gen_k8s.py"


@pytest.mark.parametrize("which", ["source", "rendered"])
def test_dashboard_configmap_equals_the_dashboard(which, request):
    docs = _source_docs() if which == "source" else request.getfixturevalue("rendered")
    cm = one(docs, "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"] == {DASHBOARD.name: DASHBOARD.read_text()}


def test_prometheus_rule_equals_rules_yaml_and_passes_promtool(source_docs, tmp_path):
    pr = one(source_docs, "PrometheusRule")
    assert pr["spec"] == load_yaml(RULES)
    promtool = tool("promtool")
    f = tmp_path / "prometheusrule-spec.yaml"
    f.write_text(yaml.safe_dump(pr["spec"], sort_keys=False))
    res = run([promtool, "check", "rules", str(f)])
    assert res.returncode == 0, res.stdout + res.stderr


# ------------------------------------------------------------------------------- image

def test_dockerfile_rocm():
    text = (REPO / "deploy" / "Dockerfile.rocm").read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert froms == ["${BASE_IMAGE}"]
    base = re.search(r"^ARG BASE_IMAGE=(\S+)", text, re.M).group(1)
    assert base.startswith("rocm/pytorch"), base
    assert re.search(r'pip install [^\n]*"\.\[rocm\]"', text), "install the project's rocm extra"
    assert "torch.version.hip" in text, "refuse a non-ROCm torch"
    assert "wget" in text, "KubeRay's probes run wget in the container"
    for port in ("8000", "8080", "6379", "8265"):
        assert port in text
