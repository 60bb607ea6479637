"""Every deploy/*.yaml passes Ray's ServeDeploySchema, a recursive unknown-key check (the schema
silently ignores unknown keys), `Deployment.options(**cfg)`, and our own ServeArgs (unknown app args
are an error); and `serve deploy` of deploy/serve_config.yaml reached RUNNING and answers."""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
import yaml

from glm_ray.serve.args import ServeArgs
from tests.deploy.serve_schema import validate_serve_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "deploy").glob("serve_config*.yaml"))


def test_configs_exist():
    assert {p.name for p in CONFIGS} >= {"serve_config.yaml", "serve_config.h200.yaml", "serve_config.mi355x.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_serve_config_strict(path):
    cfg = yaml.safe_load(path.read_text())
    validate_serve_config(cfg)
    for app in cfg["applications"]:
        assert app["import_path"] == "glm_ray.serve.app:build_app"
        ServeArgs.from_dict(app.get("args"))


def test_unknown_app_arg_rejected():
    with pytest.raises(ValueError, match="unknown glm-ray app argument"):
        ServeArgs.from_dict({"model": "tiny", "tensor_parallel": 2})


@pytest.mark.parametrize("bad", [0.0, 1.5, -0.2])
def test_gpu_memory_utilization_out_of_range_rejected(bad):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        ServeArgs.from_dict({"model": "tiny", "gpu_memory_utilization": bad})


def test_cli_and_engine_take_gpu_memory_utilization():
    from glm_ray.cli import build_parser
    from glm_ray.config import make_engine_config
    for cmd in ("serve", "generate"):
        assert build_parser().parse_args([cmd, "--gpu-memory-utilization", "0.8"]).gpu_memory_utilization == 0.8
    assert make_engine_config("m", gpu_memory_utilization=0.8).cache.gpu_memory_utilization == 0.8
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        make_engine_config("m", gpu_memory_utilization=1.2)


def test_serve_deploy_running_and_answers(serve_cluster, tiny_server):
    st = yaml.safe_load(serve_cluster.serve_cli("status").stdout)
    assert st["applications"]["glm-ray"]["status"] == "RUNNING"
    body = json.dumps({"model": tiny_server.model, "prompt": "Hello", "max_tokens": 4}).encode()
    req = urllib.request.Request(tiny_server.base_url + "/v1/completions", body,
                                 {"content-type": "application/json"})
    out = json.load(urllib.request.urlopen(req, timeout=60))
    assert out["usage"]["completion_tokens"] >= 1
