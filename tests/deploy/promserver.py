"""A real Prometheus server for tests: loopback only, a temporary TSDB, stopped by PID.

    from promserver import prometheus_server

    with prometheus_server(["127.0.0.1:8080"], rule_files=[RULES]) as prom:
        prom.wait_for('up{job="glm-ray"} == 1', timeout=30)
        prom.wait_for("ray_glm_ray_time_to_first_token_seconds_count > 0", timeout=60)
        result = prom.query("sum(rate(ray_glm_ray_generation_tokens_total[10s]))")

Runs the `prometheus` binary (Debian: `apt-get install -y --no-install-recommends prometheus`)
with `scrape_interval: 1s` against static targets, on a free port of 127.0.0.1. Things to know
(Prometheus 2.42): `/-/ready` answers within a fraction of a second but the first scrape
happens ~5 s after start (the scrape manager's reload delay), and a `rate()` needs two scrapes
after a change, so poll with `wait_for` instead of sleeping. Ray exports its metrics every
few seconds on top of that.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import yaml

from tests.cluster import free_port  # one port allocator for the session (test_deploy_promserver imports it here)


class PromServerError(RuntimeError):
    pass


class PromQueryError(PromServerError):
    """The server rejected a query (bad PromQL: errorType "bad_data")."""


class PromServer:
    """One Prometheus process. Use `prometheus_server(...)` or `start()`/`stop()`."""

    def __init__(self, targets: Iterable[str], *, job: str = "glm-ray",
                 rule_files: Iterable[str | Path] = (), scrape_interval: str = "1s",
                 evaluation_interval: str = "1s", metrics_path: str = "/metrics",
                 binary: str | None = None, port: int | None = None,
                 workdir: str | Path | None = None, ready_timeout: float = 30.0):
        self.targets = list(targets)
        self.job = job
        self.rule_files = [str(Path(f).resolve()) for f in rule_files]
        self.scrape_interval = scrape_interval
        self.evaluation_interval = evaluation_interval
        self.metrics_path = metrics_path
        self.binary = binary or shutil.which("prometheus")
        self.port = port
        self.ready_timeout = ready_timeout
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else None
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "prometheus.log"

    def config(self) -> dict:
        cfg: dict[str, Any] = {
            "global": {"scrape_interval": self.scrape_interval,
                       "scrape_timeout": self.scrape_interval,
                       "evaluation_interval": self.evaluation_interval},
            "scrape_configs": [{"job_name": self.job, "metrics_path": self.metrics_path,
                                "static_configs": [{"targets": self.targets}]}],
        }
        if self.rule_files:
            cfg["rule_files"] = self.rule_files
        return cfg

    def start(self) -> "PromServer":
        if self.binary is None:
            raise PromServerError("prometheus binary not found (apt-get install prometheus)")
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="promserver-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        cfg_path = self.workdir / "prometheus.yml"
        cfg_path.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        cmd = [self.binary, f"--config.file={cfg_path}",
               f"--storage.tsdb.path={self.workdir / 'data'}",
               f"--web.listen-address=127.0.0.1:{self.port}",
               "--web.enable-lifecycle", "--log.level=info"]
        log = open(self.log_path, "wb")
        try:
            # Own session: a stray child cannot outlive stop(), and Ctrl-C in pytest
            # does not race our shutdown.
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        self.pid = self.proc.pid
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PromServerError(f"prometheus exited with {self.proc.returncode}:\n"
                                      f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        raise PromServerError(f"prometheus not ready after {self.ready_timeout}s:\n"
                              f"{self.log_tail()}")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM our PID, wait, then SIGKILL; remove the temporary directory."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(timeout=timeout)
        self.proc = None
        if self._own_workdir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self) -> "PromServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except (OSError, TypeError):
            return "<no log>"

    # ------------------------------------------------------------------ HTTP API

    def api(self, path: str, params: dict | None = None, timeout: float = 10.0) -> Any:
        url = self.url + path
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:   # 400/422: the body still explains
            body = json.loads(e.read() or b"{}")
        if body.get("status") != "success":
            raise PromQueryError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """Instant query; the vector/matrix result list (a scalar comes back as one item)."""
        params = {"query": expr}
        if at is not None:
            params["time"] = str(at)
        data = self.api("/api/v1/query", params)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def query_values(self, expr: str) -> dict[tuple, float]:
        """{sorted label items: value} of an instant vector query."""
        return {tuple(sorted(r["metric"].items())): float(r["value"][1])
                for r in self.query(expr)}

    def active_targets(self) -> list[dict]:
        return self.api("/api/v1/targets")["activeTargets"]

    def rules(self) -> list[dict]:
        return self.api("/api/v1/rules")["groups"]

    def wait_for(self, expr: str, timeout: float = 30.0, interval: float = 0.25,
                 predicate: Callable[[list[dict]], bool] = bool) -> list[dict]:
        """Poll `expr` until `predicate(result)` (default: non-empty); return the result."""
        deadline = time.monotonic() + timeout
        last: list[dict] = []
        while True:
            last = self.query(expr)
            if predicate(last):
                return last
            if time.monotonic() >= deadline:
                break
            time.sleep(interval)
        try:
            health = [(t.get("scrapeUrl"), t.get("health"), t.get("lastError"))
                      for t in self.active_targets()]
        except PromServerError as e:
            health = [str(e)]
        raise TimeoutError(f"{expr!r} not satisfied within {timeout}s; last result {last}; "
                           f"targets {health}")


@contextlib.contextmanager
def prometheus_server(targets: Iterable[str], **kwargs) -> Iterator[PromServer]:
    """Start Prometheus scraping `targets` (host:port) every second; stop it on exit."""
    server = PromServer(targets, **kwargs)
    server.start()
    try:
        yield server
    finally:
        server.stop()
