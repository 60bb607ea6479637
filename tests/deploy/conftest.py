"""tests/deploy: offline checks of metrics, dashboard, Prometheus rules and k8s manifests.

Helper modules live beside the tests (deploy_helpers, serve_schema, promserver); pytest's
default import mode puts this folder on sys.path. The repository root is added too, so the
tests also run from a plain checkout where glm_ray is not installed.
"""
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]
for _p in (str(_REPO), str(Path(__file__).resolve().parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)
