"""`glm-ray serve --throughput-optimized`: Ray Serve's throughput-optimized mode (Ray 2.60's
RAY_SERVE_THROUGHPUT_OPTIMIZED: direct ingress, gRPC between deployments, user code on the replica's event loop)
for the local Ray the CLI starts. The flag's checks run without Ray; the served test starts the CLI as a
subprocess (its own local Ray beside the session's test cluster) and checks, with the official `openai` client,
that --port is answered by the ingress replica itself, greedy outputs equal the default deployment's (the
session's `tiny_server`, through Serve's proxy: same tiny model, float32, CPU), streaming ends properly, errors
keep the OpenAI shape, a request id that crashed Serve's proxy (non-ASCII) leaves the server up, and Serve's
proxy still answers on the port the CLI printed for it."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import requests

from glm_ray import cli
from tests.cluster import free_port

ROOT = Path(__file__).resolve().parents[2]
FIXED = {"ignore_eos": True}


def _parse(*argv: str):
    return cli.build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize("argv,message", [
    (("--throughput-optimized", "--address", "auto"), "on a cluster set RAY_SERVE_THROUGHPUT_OPTIMIZED=1"),
    (("--throughput-optimized", "--ingress-replicas", "2"), "--ingress-replicas 1"),
])
def test_flag_refuses_what_it_cannot_serve(argv, message, monkeypatch):
    """Checked before Ray starts (and before any Ray variable is set in this process)."""
    monkeypatch.delenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", raising=False)
    with pytest.raises(SystemExit, match=re.escape(message)):
        cli.cmd_serve(_parse(*argv))
    assert "RAY_SERVE_THROUGHPUT_OPTIMIZED" not in os.environ


@pytest.fixture(scope="module")
def optimized_server(tmp_path_factory):
    port, metrics_port = free_port(), free_port()     # never the same port twice (tests/cluster.py)
    log = tmp_path_factory.mktemp("throughput-optimized") / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}     # not the session's cluster
    env.update(PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "glm_ray.cli", "serve", "--throughput-optimized",
                                 "--port", str(port), "--metrics-port", str(metrics_port), "--num-cpus", "2",
                                 "--device", "cpu", "--dtype", "float32", "--max-num-seqs", "8",
                                 "--kv-cache-memory-gb", "0.1"],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=ROOT)
    try:
        deadline, proxy_port = time.time() + 420, None
        while time.time() < deadline and proxy_port is None:
            assert proc.poll() is None, log.read_text()[-3000:]
            m = re.search(r"the ingress replica on :(\d+) \(direct ingress\), Serve's proxy on :(\d+)", log.read_text())
            if m:
                assert int(m.group(1)) == port
                proxy_port = int(m.group(2))
            time.sleep(2)
        assert proxy_port, log.read_text()[-3000:]
        yield port, proxy_port, log
    finally:
        proc.send_signal(signal.SIGTERM)          # the CLI's clean stop: serve.shutdown(), ray.shutdown()
        try:
            proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _listener(port: int) -> str:
    """The process name listening on 127.0.0.1:port (Ray names its workers `ray::<Actor>`)."""
    out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True).stdout
    m = re.search(r'users:\(\("([^"]+)"', out)
    return m.group(1) if m else out


def test_served_by_the_ingress_replica_with_the_default_deployments_outputs(optimized_server, tiny_server):
    port, proxy_port, log = optimized_server
    if subprocess.run(["which", "ss"], capture_output=True).returncode == 0:
        assert _listener(port).startswith("ray::ServeRepli"), _listener(port)      # not ray::ProxyActor
        assert _listener(proxy_port).startswith("ray::ProxyActor"), _listener(proxy_port)
    fast = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY", max_retries=0, timeout=180)
    ref = openai.OpenAI(base_url=tiny_server.base_url + "/v1", api_key="EMPTY", max_retries=0, timeout=180)
    model = fast.models.list().data[0].id
    assert model == tiny_server.model
    for prompt in ("The capital of France is", "1 2 3 4"):
        got = fast.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, extra_body=FIXED)
        want = ref.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, extra_body=FIXED)
        assert got.choices[0].text == want.choices[0].text
        assert got.usage.completion_tokens == 12
    # streamed: the chunks' text is the non-streamed text, one finish_reason at the end
    chunks = list(fast.completions.create(model=model, prompt="1 2 3 4", max_tokens=12, temperature=0,
                                          stream=True, extra_body=FIXED))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == got.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    chat = fast.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                        stream=True, extra_body={**FIXED, "chat_template_kwargs": {"enable_thinking": False}})
    assert sum(1 for c in chat if c.choices and c.choices[0].finish_reason) == 1
    # errors keep the OpenAI shape
    with pytest.raises(openai.NotFoundError) as e:
        fast.completions.create(model="nope", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    # a non-ASCII x-request-id (it crashed Serve's proxy: serve/proxy_middleware.py) is answered, the server stays up
    r = requests.post(f"http://127.0.0.1:{port}/v1/completions", headers={"x-request-id": "caf\u00e9".encode()},
                      json={"model": model, "prompt": "x", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    assert fast.models.list().data[0].id == model
    # Serve's proxy, moved off --port, still routes to the app
    assert requests.get(f"http://127.0.0.1:{proxy_port}/v1/models", timeout=60).json()["data"][0]["id"] == model
