"""Every deploy/*.yaml passes Ray's ServeDeploySchema, a recursive unknown-key check (the schema
silently ignores unknown keys), `Deployment.options(**cfg)`, and our own ServeArgs (unknown app args
are an error); and `serve deploy` of deploy/serve_config.yaml reached RUNNING and answers."""
from __future__ import annotations

import json
import os
import re
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


@pytest.mark.parametrize("args,want", [
    ({"tp": "2"}, {"tp": 2}), ({"tp": " 3 "}, {"tp": 3}), ({"tp": 4}, {"tp": 4}),
    ({"fp8_proj_gemm": "true"}, {"fp8_proj_gemm": True}), ({"fp8_proj_gemm": "0"}, {"fp8_proj_gemm": False}),
    ({"fp8_proj_gemm": "Off"}, {"fp8_proj_gemm": False}), ({"fp8_proj_gemm": True}, {"fp8_proj_gemm": True}),
    ({"gpu_memory_utilization": "0.5"}, {"gpu_memory_utilization": 0.5}),
    ({"gpu_memory_utilization": 1}, {"gpu_memory_utilization": 1.0}),
    ({"max_model_len": "none"}, {"max_model_len": None}), ({"max_model_len": "4096"}, {"max_model_len": 4096}),
    ({"kv_cache_memory_gb": "null"}, {"kv_cache_memory_gb": None}), ({"router_cpus": "1"}, {"router_cpus": 1.0}),
    ({"served_model_name": "none"}, {"served_model_name": None}), ({"model": "/models/GLM-5"}, {"model": "/models/GLM-5"}),
])
def test_serve_run_string_forms_parse_by_field_type(args, want):
    """`serve run glm_ray.serve.app:build_app tp=2` passes every value as a string."""
    a = ServeArgs.from_dict(args)
    assert {k: getattr(a, k) for k in want} == want
    assert all(type(getattr(a, k)) is type(v) for k, v in want.items())


@pytest.mark.parametrize("args,name", [
    ({"tp": "abc"}, "tp"), ({"tp": "1.5"}, "tp"), ({"tp": 1.5}, "tp"), ({"tp": True}, "tp"), ({"tp": None}, "tp"),
    ({"tp": "0"}, "tp"), ({"fp8_proj_gemm": "maybe"}, "fp8_proj_gemm"), ({"fp8_proj_gemm": 1}, "fp8_proj_gemm"),
    ({"gpu_memory_utilization": "lots"}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": "nan"}, "gpu_memory_utilization"),
    ({"kv_cache_memory_gb": "-1"}, "kv_cache_memory_gb"), ({"max_num_seqs": "0"}, "max_num_seqs"),
    ({"device": "tpu"}, "device"), ({"dtype": "fp8"}, "dtype"), ({"load_format": "lazy"}, "load_format"),
    ({"kernel_backend": "triton"}, "kernel_backend"), ({"model": 7}, "model"), ({"model": ""}, "model"),
    ({"max_queued_requests": "-1"}, "max_queued_requests"), ({"ingress_replicas": "0"}, "ingress_replicas"),
    ({"trust_request_chat_template": "sure"}, "trust_request_chat_template"),
])
def test_bad_app_argument_names_it(args, name):
    with pytest.raises(ValueError, match=rf"argument {name}\b"):
        ServeArgs.from_dict(args)


def test_api_key_from_arg_or_env_and_never_shown(monkeypatch):
    monkeypatch.delenv("GLM_RAY_API_KEY", raising=False)
    assert ServeArgs.from_dict({}).api_key is None
    a = ServeArgs.from_dict({"api_key": "s3cret-key"})
    assert a.api_key == "s3cret-key" and a.to_dict()["api_key"] == "s3cret-key"   # Router/ingress get it
    assert ServeArgs.from_dict(a.to_dict()) == a                                   # the round trip they do
    assert "s3cret-key" not in repr(a) and "s3cret-key" not in str(a.to_log_dict())
    monkeypatch.setenv("GLM_RAY_API_KEY", "from-env")
    assert ServeArgs.from_dict({}).api_key == "from-env"                          # as VLLM_API_KEY
    assert ServeArgs.from_dict({"api_key": "explicit"}).api_key == "explicit"
    assert "from-env" not in repr(ServeArgs.from_dict({}))


def test_trust_request_chat_template_defaults_off():
    assert ServeArgs.from_dict({}).trust_request_chat_template is False
    assert ServeArgs.from_dict({"trust_request_chat_template": "true"}).trust_request_chat_template is True


def test_cli_serve_flags_become_app_args(monkeypatch):
    from glm_ray.cli import build_parser, serve_app_args
    monkeypatch.delenv("GLM_RAY_API_KEY", raising=False)
    a = build_parser().parse_args(["serve", "--api-key", "k", "--trust-request-chat-template", "--max-num-seqs", "8"])
    args = serve_app_args(a)
    assert (args["api_key"], args["trust_request_chat_template"], args["max_num_seqs"]) == ("k", True, 8)
    plain = serve_app_args(build_parser().parse_args(["serve"]))
    assert "api_key" not in plain and "trust_request_chat_template" not in plain
    sa = ServeArgs.from_dict(plain)
    assert sa.model_name() == "glm5-tiny" and sa.api_key is None
    a = build_parser().parse_args(["serve"])
    assert (a.host, a.ray_node_ip, a.port, a.metrics_port) == ("127.0.0.1", "127.0.0.1", 8000, 8080)


def test_cli_serve_keeps_ray_on_loopback(monkeypatch):
    """`glm-ray serve` starts Ray in its single-node mode (node IP 127.0.0.1, every Ray port on loopback)
    unless --ray-node-ip names another address; checked at the ray.init call, nothing is started."""
    import ray
    from ray._private import ray_constants

    from glm_ray import cli

    class Started(Exception):
        pass

    def fake_init(**kw):
        raise Started(kw, os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"), ray_constants.ENABLE_RAY_CLUSTER)

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    monkeypatch.setattr("glm_ray.model.tiny.default_tiny_model", lambda *a, **k: None)
    with pytest.raises(Started) as e:
        cli.main(["serve", "--host", "0.0.0.0", "--metrics-port", "9123"])
    kw, env, cluster = e.value.args
    assert (kw["_node_ip_address"], kw["include_dashboard"], kw["_metrics_export_port"]) == ("127.0.0.1", False, 9123)
    assert (env, cluster) == ("0", False)
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    with pytest.raises(Started) as e:
        cli.main(["serve", "--ray-node-ip", "10.1.2.3"])
    kw, env, cluster = e.value.args
    assert (kw["_node_ip_address"], env, cluster) == ("10.1.2.3", None, True)


def test_cli_version_and_help(capsys):
    import glm_ray
    from glm_ray.cli import build_parser
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"glm-ray {glm_ray.__version__}"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    assert "quantize" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag, default in (("--max-num-seqs", "64"), ("--host", "127.0.0.1"), ("--port", "8000"),
                          ("--kernel-backend", "auto"), ("--fp8-proj-min-tokens", "512"),
                          ("--ray-node-ip", "127.0.0.1")):
        assert re.search(re.escape(flag) + r" \S+ .*?\(default: " + re.escape(default) + r"\)", out), flag
    assert "--num-cpus" in out and "--api-key" in out and "--trust-request-chat-template" in out
    with pytest.raises(SystemExit):
        build_parser().parse_args(["make-tiny", "--help"])
    assert "(default: 0)" in " ".join(capsys.readouterr().out.split())       # --seed


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
