"""`glm-ray serve` / `glm-ray generate` flags are generated from `ServeArgs` (glm_ray/serve/args.py): one
flag per field, the field's default, `vllm serve`'s names where the concept is the same (the expected
values below are written out by hand from vLLM's documented meaning, not computed by our parser), and
the older spellings still accepted. No Ray is started."""
from __future__ import annotations

import argparse
import os
import re
from dataclasses import fields

import pytest

from glm_ray import cli
from glm_ray.config import make_engine_config
from glm_ray.serve import args as serve_args
from glm_ray.serve.args import APP, ENGINE, ServeArgs

GiB = 2**30
#: flags of `glm-ray serve` that are not app settings (the local Ray, the HTTP bind)
SERVE_CLI_ONLY = {"help", "host", "port", "metrics_port", "metrics_report_interval_ms", "ray_node_ip", "address",
                  "num_cpus", "throughput_optimized"}
#: flags of `glm-ray generate` that are not engine settings (the prompts and their sampling)
GENERATE_CLI_ONLY = {"help", "prompt", "chat", "max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos"}


@pytest.fixture(autouse=True)
def _no_env_fallbacks(monkeypatch):
    monkeypatch.delenv("GLM_RAY_API_KEY", raising=False)
    monkeypatch.delenv("GLM_RAY_FP8_PROJ_GEMM", raising=False)


def _subparser(cmd: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[cmd]


def _resolved(*argv: str) -> ServeArgs:
    """What `glm-ray serve ARGV` deploys (cmd_serve's first step, without Ray)."""
    return ServeArgs.from_dict(cli.serve_app_args(cli.build_parser().parse_args(["serve", *argv])))


@pytest.mark.parametrize("cmd,scopes,cli_only", [("serve", (ENGINE, APP), SERVE_CLI_ONLY),
                                                 ("generate", (ENGINE,), GENERATE_CLI_ONLY)])
def test_every_setting_has_exactly_one_flag(cmd, scopes, cli_only):
    actions = _subparser(cmd)._actions
    by_dest: dict[str, list] = {}
    for a in actions:
        by_dest.setdefault(a.dest, []).append(a)
    want = {f.name for f in fields(ServeArgs) if f.metadata["setting"].scope in scopes}
    assert want, scopes
    for name in want:
        assert len(by_dest.get(name, [])) == 1, f"{cmd}: {name} has {len(by_dest.get(name, []))} flags"
    assert set(by_dest) == want | cli_only, f"{cmd}: flags that are neither settings nor known CLI-only ones: " \
                                            f"{sorted(set(by_dest) - want - cli_only)}"
    if cmd == "serve":
        assert want == {f.name for f in fields(ServeArgs)}      # serve: every app setting


def test_defaults_are_servearg_defaults(capsys):
    """No flag given = the ServeArgs default (every generated flag defaults to "not given"), and --help
    shows that default."""
    expected = {f.name: f.default for f in fields(ServeArgs)}
    got = _resolved()
    assert {k: getattr(got, k) for k in expected} == expected
    gen = cli.build_parser().parse_args(["generate"])
    assert ServeArgs.from_dict(serve_args.values_from_flags(gen, cli.GENERATE_SCOPES)) == ServeArgs.from_dict({})
    for a in _subparser("serve")._actions:
        if a.dest in expected:
            assert a.default is None, a.dest
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for f, s in serve_args.settings():
        if f.default is None:
            assert s.default_help, f"{f.name}: a None default needs its words (default_help)"
            continue
        flag = f.name if s.positional else serve_args.flag_name(f, s)
        assert re.search(re.escape(flag) + r"[ ,].*?\(default: " + re.escape(str(f.default)) + r"[):]", out), flag


VLLM_FLAGS = [   # (argv after `glm-ray serve`, field, value as vLLM documents the flag)
    (["--tensor-parallel-size", "2"], "tp", 2),
    (["-tp", "4"], "tp", 4),
    (["--max-model-len", "4096"], "max_model_len", 4096),
    (["--max-model-len", "32k"], "max_model_len", 32_000),          # lower case: powers of 1000
    (["--max-model-len", "32K"], "max_model_len", 32_768),          # upper case: powers of 1024
    (["--max-model-len", "25.6k"], "max_model_len", 25_600),
    (["--max-num-seqs", "8"], "max_num_seqs", 8),
    (["--max-num-batched-tokens", "8192"], "max_num_batched_tokens", 8192),
    (["--max-num-batched-tokens", "16k"], "max_num_batched_tokens", 16_000),
    (["--gpu-memory-utilization", "0.85"], "gpu_memory_utilization", 0.85),
    (["--kv-cache-memory-bytes", "1073741824"], "kv_cache_memory_bytes", GiB),
    (["--kv-cache-memory-bytes", "8G"], "kv_cache_memory_bytes", 8 * GiB),
    (["--kv-cache-memory-bytes", "8Gi"], "kv_cache_memory_bytes", 8 * GiB),
    (["--kv-cache-memory-bytes", "2g"], "kv_cache_memory_bytes", 2_000_000_000),
    (["--served-model-name", "glm-5"], "served_model_name", "glm-5"),
    (["--enforce-eager"], "enforce_eager", True),
    (["--no-enforce-eager"], "enforce_eager", False),
    (["--async-scheduling"], "async_scheduling", True),
    (["--no-async-scheduling"], "async_scheduling", False),
    (["--api-key", "sk-test"], "api_key", "sk-test"),
    (["--block-size", "32"], "block_size", 32),
    (["--dtype", "bfloat16"], "dtype", "bfloat16"),
    (["--dtype", "half"], "dtype", "float16"),
    (["--dtype", "float"], "dtype", "float32"),
    (["--load-format", "dummy"], "load_format", "dummy"),
    (["--load-format", "safetensors"], "load_format", "auto"),
    (["--trust-request-chat-template"], "trust_request_chat_template", True),
    (["--no-trust-request-chat-template"], "trust_request_chat_template", False),
    (["/models/GLM-5"], "model", "/models/GLM-5"),
]


@pytest.mark.parametrize("argv,field,value", VLLM_FLAGS, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_vllm_flag_names_mean_the_same(argv, field, value):
    got = getattr(_resolved(*argv), field)
    assert got == value and type(got) is type(value), (argv, got)


def test_a_copied_vllm_serve_command_parses():
    sa = _resolved("/models/GLM-5", "--tensor-parallel-size", "8", "--max-model-len", "32768", "--max-num-seqs",
                   "128", "--max-num-batched-tokens", "8192", "--gpu-memory-utilization", "0.92",
                   "--served-model-name", "glm-5", "--enforce-eager", "--api-key", "k", "--dtype", "bfloat16",
                   "--block-size", "32", "--no-async-scheduling", "--trust-request-chat-template")
    assert (sa.model, sa.tp, sa.max_model_len, sa.max_num_seqs, sa.max_num_batched_tokens, sa.gpu_memory_utilization,
            sa.served_model_name, sa.enforce_eager, sa.api_key, sa.dtype, sa.block_size, sa.async_scheduling,
            sa.trust_request_chat_template) == ("/models/GLM-5", 8, 32768, 128, 8192, 0.92, "glm-5", True, "k",
                                                 "bfloat16", 32, False, True)


@pytest.mark.parametrize("argv,field,value", [
    (["--tp", "2"], "tp", 2),
    (["--kv-cache-memory-gb", "0.25"], "kv_cache_memory_gb", 0.25),
    (["--engine-in-router"], "engine_in_worker", False),
    (["--no-engine-in-worker"], "engine_in_worker", False),
    (["--fp8-proj-gemm"], "fp8_proj_gemm", True),
    (["--fp8-proj-min-tokens", "8192"], "fp8_proj_min_tokens", 8192),
    (["--max-queued-requests", "5"], "max_queued_requests", 5),
    (["--ingress-replicas", "2"], "ingress_replicas", 2),
    (["--router-cpus", "1.5"], "router_cpus", 1.5),
    (["--accelerator-type", "H200"], "accelerator_type", "H200"),
    (["--kernel-backend", "torch"], "kernel_backend", "torch"),
    (["--device", "cpu"], "device", "cpu"),
])
def test_old_and_own_names_still_work(argv, field, value):
    assert getattr(_resolved(*argv), field) == value


def test_kv_cache_size_in_either_unit_reaches_the_engine():
    assert _resolved("--kv-cache-memory-gb", "0.25").kv_cache_bytes() == GiB // 4
    assert _resolved("--kv-cache-memory-bytes", "256Mi").kv_cache_bytes() == GiB // 4
    assert _resolved().kv_cache_bytes() is None
    with pytest.raises(ValueError, match="kv_cache_memory_gb"):        # the same size twice: say which
        _resolved("--kv-cache-memory-gb", "1", "--kv-cache-memory-bytes", "1Gi")
    # serve configs take vLLM's human-readable sizes too
    assert ServeArgs.from_dict({"kv_cache_memory_bytes": "512Mi"}).kv_cache_bytes() == GiB // 2


def test_the_env_fallbacks_apply_only_when_the_flag_is_not_given(monkeypatch):
    monkeypatch.setenv("GLM_RAY_FP8_PROJ_GEMM", "1")
    monkeypatch.setenv("GLM_RAY_API_KEY", "from-env")
    assert _resolved().fp8_proj_gemm is True and _resolved().api_key == "from-env"
    assert _resolved("--no-fp8-proj-gemm").fp8_proj_gemm is False
    assert _resolved("--api-key", "flag").api_key == "flag"


@pytest.mark.parametrize("argv,message", [
    (["--tensor-parallel-size", "two"], "argument --tensor-parallel-size/-tp/--tp: glm-ray app argument tp"),
    (["--max-model-len", "1.5K"], "argument --max-model-len: glm-ray app argument max_model_len"),
    (["--kv-cache-memory-bytes", "lots"], "argument --kv-cache-memory-bytes"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["--gpu-memory-utilization", "nan"], "expected a finite number"),
    (["--enforce-eager=yes"], "ignored explicit argument"),
])
def test_bad_flag_values_exit_2_naming_the_flag(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["serve", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_app_flags_are_not_generate_flags(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "--api-key", "k"])
    assert "unrecognized arguments: --api-key" in capsys.readouterr().err


#: a value other than the default for each engine setting (a new engine field must be added here)
NON_DEFAULT = {"tp": 2, "device": "cpu", "dtype": "float32", "load_format": "dummy", "kernel_backend": "torch",
               "fp8_proj_gemm": True, "fp8_proj_min_tokens": 7, "enforce_eager": True, "async_scheduling": True, "enable_prefix_caching": False,
               "max_num_seqs": 3, "max_num_batched_tokens": 99, "max_model_len": 512, "block_size": 32,
               "gpu_memory_utilization": 0.5, "kv_cache_memory_bytes": 2**20, "kv_cache_memory_gb": 0.25,
               "gpus_per_rank": 0.5, "piecewise_cuda_graph_max_tokens": 0, "schedule_policy": "lpm"}


@pytest.mark.parametrize("name", [f.name for f, s in serve_args.settings((ENGINE,)) if not s.positional])
def test_every_engine_setting_reaches_the_engine_config(name):
    """`engine_kwargs()` (what the Router and `glm-ray generate` build the engine from) carries each
    engine setting: changing it changes the EngineConfig."""
    base = make_engine_config("m", **ServeArgs.from_dict({}).engine_kwargs())
    changed = make_engine_config("m", **ServeArgs.from_dict({name: NON_DEFAULT[name]}).engine_kwargs())
    assert changed != base, name


def test_generate_builds_its_engine_from_the_same_settings(monkeypatch):
    import glm_ray.llm

    class Built(Exception):
        pass

    def fake_llm(model, **kw):
        raise Built(model, kw)

    monkeypatch.setattr(glm_ray.llm, "LLM", fake_llm)
    with pytest.raises(Built) as e:
        cli.main(["generate", "/m", "-tp", "2", "--max-model-len", "2k", "--kv-cache-memory-bytes", "64Mi",
                  "--enforce-eager", "--dtype", "half"])
    model, kw = e.value.args
    assert model == "/m"
    cfg = make_engine_config(model, **kw)
    assert (cfg.parallel.tensor_parallel_size, cfg.scheduler.max_model_len, cfg.cache.kv_cache_memory_bytes,
            cfg.enforce_eager, cfg.dtype) == (2, 2000, 64 * 2**20, True, "float16")


def test_serve_passes_the_metrics_export_interval_to_ray(monkeypatch):
    """`--metrics-report-interval-ms` becomes Ray's `metrics_report_interval_ms` system config of the local
    Ray (checked at the ray.init call; nothing is started)."""
    import ray
    from ray._private import ray_constants

    from glm_ray.serve import proxy_middleware

    class Started(Exception):
        pass

    def fake_init(**kw):
        raise Started(kw)

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr("glm_ray.model.tiny.default_tiny_model", lambda *a, **k: None)
    # cmd_serve's process-wide settings, undone after the test
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", ray_constants.ENABLE_RAY_CLUSTER)
    for key in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE", proxy_middleware.ENV):
        if key in os.environ:
            monkeypatch.setenv(key, os.environ[key])
        else:
            monkeypatch.delenv(key, raising=False)
    for argv, want in (([], cli.METRICS_REPORT_INTERVAL_MS), (["--metrics-report-interval-ms", "500"], 500)):
        with pytest.raises(Started) as e:
            cli.main(["serve", *argv])
        assert e.value.args[0]["_system_config"] == {"metrics_report_interval_ms": want}


def test_a_shared_gpu_reserves_its_share_and_needs_its_own_kv_budget():
    """--gpus-per-rank 0.5: the Router's rank bundles ask Ray for half a GPU (two replicas pack onto one);
    refused at TP > 1 and, on a GPU, without an explicit KV budget."""
    from glm_ray.serve.router import router_deployment
    args = ServeArgs.from_dict({"device": "cuda", "gpus_per_rank": 0.5, "kv_cache_memory_bytes": "8Gi"})
    bundles = router_deployment(args)._replica_config.placement_group_bundles
    assert bundles[1:] == [{"GPU": 0.5, "CPU": 1}]
    assert make_engine_config("m", **args.engine_kwargs()).parallel.gpus_per_rank == 0.5
    with pytest.raises(ValueError, match="gpus_per_rank"):
        ServeArgs.from_dict({"device": "cuda", "gpus_per_rank": 0.5})
    with pytest.raises(ValueError, match="gpus_per_rank"):
        ServeArgs.from_dict({"device": "cuda", "gpus_per_rank": 0.5, "kv_cache_memory_bytes": "8Gi", "tp": 2})
    with pytest.raises(ValueError, match="gpus_per_rank"):
        ServeArgs.from_dict({"gpus_per_rank": 0})
    with pytest.raises(ValueError, match="gpus_per_rank"):
        make_engine_config("m", tensor_parallel_size=2, gpus_per_rank=0.5)
