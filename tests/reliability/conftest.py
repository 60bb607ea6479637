"""Fixtures of the reliability suite: the session's Serve cluster (tests/conftest.py, with the
"faults" app of tests/reliability/apps.py), a Ray driver for the Routers' stats, and a guard that
leaves every app serving for the suites that run after this one."""
from __future__ import annotations

import pytest

from tests.reliability import harness as H


@pytest.fixture(scope="session")
def main_app(serve_cluster):
    return serve_cluster.apps["glm-ray"]


@pytest.fixture(scope="session")
def faults_app(serve_cluster):
    return serve_cluster.apps["faults"]


@pytest.fixture(scope="module")
def ray_driver(serve_cluster):
    """Connected for one module only: other suites call ray.init() themselves."""
    with H.RayDriver(serve_cluster.gcs_address, serve_cluster.dashboard_url) as rd:
        yield rd


@pytest.fixture(scope="module", autouse=True)
def _apps_serving_afterwards(request):
    """After each module that talks to the cluster: wait (bounded) until the apps serve again, so a
    server bug found here does not fail the next suites with a dead engine's 503s."""
    if not getattr(request.module, "USES_CLUSTER", False):
        yield
        return
    cluster = request.getfixturevalue("serve_cluster")
    yield
    for name in ("glm-ray", "faults"):
        app = cluster.apps.get(name)
        if app is not None:
            try:
                H.wait_healthy(app.base_url, app.model, timeout=180)
            except TimeoutError as e:          # reported, not raised: the module's own tests failed already
                print(f"[reliability] {e}")
