"""One Ray cluster for the whole test session, started the way users start it:
`ray start --head` + `serve deploy <config>` + `serve status`, all on 127.0.0.1.

The deployed config is deploy/serve_config.yaml's application, unchanged, plus test-only
applications (TP=2, fp8_proj on) appended, and the HTTP port moved to a free one.
"""
from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


_GIVEN: set[int] = set()     # ports this process handed out: never twice (the OS may offer a freed one again)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 that no earlier call returned (two consecutive bind-to-0 probes can
    get the same port back once the first socket is closed: a CI run once gave Ray's object manager and
    dashboard agent the same port and `ray start` failed)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


@dataclass
class ServedApp:
    name: str
    base_url: str          # e.g. http://127.0.0.1:PORT/tp2  (the OpenAI base is base_url + "/v1")
    model: str
    max_model_len: int = 0
    vocab_size: int = 0


@dataclass
class Cluster:
    gcs_address: str
    dashboard_url: str
    metrics_port: int
    http_port: int
    apps: dict[str, ServedApp]
    env: dict
    config: dict | None = None
    tmp: Path | None = None

    def redeploy(self, config: dict) -> None:
        path = self.tmp / "serve_config.redeploy.yaml"
        path.write_text(yaml.safe_dump(config))
        r = self.serve_cli("deploy", str(path))
        if r.returncode:
            raise RuntimeError(f"serve deploy failed: {r.stdout}\n{r.stderr}")

    def serve_cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ray.serve.scripts", *args, "-a", self.dashboard_url],
                              env=self.env, capture_output=True, text=True, timeout=timeout)


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def test_config(http_port: int, extra_apps: list[dict]) -> dict:
    cfg = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    cfg = copy.deepcopy(cfg)
    cfg["http_options"]["port"] = http_port
    base = cfg["applications"][0]
    for extra in extra_apps:
        app = copy.deepcopy(base)
        app["name"], app["route_prefix"] = extra["name"], extra["route_prefix"]
        app["args"] = {**base["args"], **extra.get("args", {})}
        if "runtime_env" in extra:       # e.g. env_vars for a test-only fault-injection app
            app["runtime_env"] = copy.deepcopy(extra["runtime_env"])
        cfg["applications"].append(app)
    return cfg


def start(tmp: Path, extra_apps: list[dict], timeout: float = 600) -> Cluster:
    # GLM_RAY_TEST_FORCED_OUTPUT: every replica of this test cluster honors a request's `forced_token_ids`
    # (a known output from the random model: tests/serve/test_agent_api.py); the apps' configs stay as shipped
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0",
               RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH="glm_ray.serve.proxy_middleware:proxy_middlewares",
               GLM_RAY_TEST_FORCED_OUTPUT="1")
    gcs_port, dash_port, metrics_port, http_port = free_port(), free_port(), free_port(), free_port()
    # NOTE: every port explicit (none of Ray's defaults), so this cluster can run beside another one
    other = {flag: free_port() for flag in ("ray-client-server-port", "dashboard-agent-listen-port",
                                            "dashboard-agent-grpc-port", "runtime-env-agent-port",
                                            "node-manager-port", "object-manager-port")}
    r = subprocess.run([_bin("ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs_port}",
                    # logical CPUs: every test app's placement group (~20: 1.5 per TP=1 Router replica,
                    # 2.5 per TP=2 one, 0.1 per ingress) plus room for a rolling update's new replica
                    # beside the draining old one
                    "--num-cpus=28", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                    f"--dashboard-port={dash_port}", f"--metrics-export-port={metrics_port}",
                    "--object-store-memory=300000000", "--disable-usage-stats",
                    *(f"--{k}={v}" for k, v in other.items())],
                   env=env, capture_output=True, text=True, timeout=180)
    if r.returncode:       # say why (a port taken by another process on the machine, a Ray already running, ...)
        raise RuntimeError(f"ray start failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    env["RAY_ADDRESS"] = f"127.0.0.1:{gcs_port}"      # the Serve CLI and drivers talk to *this* cluster
    cluster = Cluster(f"127.0.0.1:{gcs_port}", f"http://127.0.0.1:{dash_port}", metrics_port, http_port, {}, env)
    try:
        return _deploy(cluster, tmp, extra_apps, timeout)
    except BaseException:
        stop(env)
        raise


def _deploy(cluster: Cluster, tmp: Path, extra_apps: list[dict], timeout: float) -> Cluster:
    http_port = cluster.http_port
    cfg = test_config(http_port, extra_apps)
    cluster.config, cluster.tmp = cfg, tmp
    cfg_path = tmp / "serve_config.test.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    _wait_dashboard(cluster.dashboard_url, timeout=120)
    r = cluster.serve_cli("deploy", str(cfg_path))
    if r.returncode:
        raise RuntimeError(f"serve deploy failed: {r.stdout}\n{r.stderr}")
    names = [a["name"] for a in cfg["applications"]]
    deadline = time.time() + timeout
    while True:
        st = cluster.serve_cli("status")
        status = yaml.safe_load(st.stdout) if st.returncode == 0 else {}
        apps = (status or {}).get("applications", {})
        states = {n: apps.get(n, {}).get("status") for n in names}
        if all(s == "RUNNING" for s in states.values()):
            break
        if any(s in ("DEPLOY_FAILED", "UNHEALTHY") for s in states.values()) or time.time() > deadline:
            raise RuntimeError(f"serve apps did not reach RUNNING: {states}\n{st.stdout}")
        time.sleep(2)
    for a in cfg["applications"]:
        prefix = a["route_prefix"].rstrip("/")
        base = f"http://127.0.0.1:{http_port}{prefix}"
        key = a["args"].get("api_key")
        req = urllib.request.Request(base + "/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {})
        info = json.load(urllib.request.urlopen(req, timeout=30))["data"][0]
        cluster.apps[a["name"]] = ServedApp(a["name"], base, info["id"], info.get("max_model_len", 0),
                                            info.get("vocab_size", 0))
    return cluster


def _wait_dashboard(url: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url + "/api/version", timeout=5)
            return
        except Exception:
            time.sleep(1)
    raise RuntimeError(f"Ray dashboard at {url} did not come up")


def stop(env: dict) -> None:
    """Stop only this cluster: kill the processes that name its GCS address (`ray stop` would kill
    every Ray cluster on the machine, e.g. a developer's or another test run's)."""
    import re

    import psutil
    port = env.get("RAY_ADDRESS", "").rsplit(":", 1)[-1]
    if not port.isdigit():
        return
    # the GCS itself, and every raylet/agent/worker/dashboard that points at it (whatever IP it uses)
    pattern = re.compile(rf"(--gcs_server_port={port}\b|(gcs[-_]address|ray\.address)=\S+:{port}\b)")
    mine = [p for p in psutil.process_iter(["cmdline"]) if pattern.search(" ".join(p.info["cmdline"] or []))]
    for p in mine:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(mine, timeout=15)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
