"""Shared fixtures: tiny checkpoints (written once per session) and, for serving tests, one Ray
session with the app running (see tests/serve/conftest.py)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# No GPU: every Triton kernel a test builds runs interpreted. Set before anything imports triton (the
# interpreter must be on when triton is imported); test modules imported later cannot do it reliably.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _write_variant(root, name: str, **overrides) -> str:
    from glm_ray.model.tiny import bundled_config, write_tiny
    path = root / name
    if not (path / "config.json").exists():
        cfg = bundled_config()
        cfg.update(overrides)
        write_tiny(path, cfg)
    return str(path)


@pytest.fixture(scope="session")
def tiny_variants(tmp_path_factory):
    """Factory: tiny_variants(name, **config overrides) -> checkpoint dir (cached per session)."""
    root = tmp_path_factory.mktemp("tiny")
    cache: dict[str, str] = {}

    def make(name: str, **overrides) -> str:
        if name not in cache:
            cache[name] = _write_variant(root, name, **overrides)
        return cache[name]
    return make


@pytest.fixture(scope="session")
def tiny_dir(tiny_variants) -> str:
    """The default tiny GLM-5 (configs/glm5-tiny.json: 16 indexer heads, FFSF IndexShare, n_group 2)."""
    return tiny_variants("default")


@pytest.fixture(scope="session")
def oracle_dir(tiny_variants) -> str:
    """Tiny GLM-5 with 16 indexer heads (now the default tiny's too; kept as its own variant).

    NOTE: with 4 heads, ReLU makes many index scores exactly 0, and top-k ties are broken differently
    by transformers depending on the total sequence length (its own logits for a prefix change when
    tokens are appended), and by the engine depending on the batch shape (prefix caching changes it).
    16 heads make exact ties negligible, so parity tests are meaningful.
    """
    return tiny_variants("idx16", index_n_heads=16)


@pytest.fixture(scope="session", params=["glm5", "glm53"])
def family_dir(request, oracle_dir, tmp_path_factory) -> str:
    """Each model family once: the tiny GLM-5 (`oracle_dir`: 16 indexer heads, index_topk 8) and the tiny
    GLM-5.3-Flash (KDA + NoPE MLA with the k-pool indexer + mHC) that transformers writes."""
    if request.param == "glm5":
        return oracle_dir
    from tests.flash_tiny import available, write_flash_tiny  # noqa: PLC0415
    if not available():
        pytest.skip("transformers without glm5_next")
    return write_flash_tiny(tmp_path_factory.mktemp("glm53-family") / "tiny")


# ---- one Ray + Serve cluster for the session -----------------------------------------------------
from tests.reliability.apps import FAULTS_APP  # noqa: E402

SECURE_API_KEY = "test-key-7f3a"

EXTRA_APPS = [
    {"name": "tp2", "route_prefix": "/tp2", "args": {"tp": 2, "served_model_name": "glm5-tiny-tp2"}},
    # the engine loop in the Router, a Ray call per step to the ranks (tests/serve/test_engine_location.py;
    # every other app runs the default: the loop in rank 0's actor)
    {"name": "inrouter", "route_prefix": "/inrouter", "args": {"tp": 2, "engine_in_worker": False, "max_num_seqs": 4,
                                                               "served_model_name": "glm5-tiny-inrouter"}},
    # async scheduling (step N+1 launched before step N's tokens are read back): tests/serve/test_async_served.py
    {"name": "async", "route_prefix": "/async", "args": {"async_scheduling": True, "max_num_seqs": 4,
                                                         "served_model_name": "glm5-tiny-async"}},
    {"name": "fp8on", "route_prefix": "/fp8on", "args": {"fp8_proj_gemm": True,
                                                         "served_model_name": "glm5-tiny-fp8on"}},
    # one running + one waiting request at most: for the overload (503) and worker-death tests
    {"name": "small", "route_prefix": "/small", "args": {"max_num_seqs": 1, "max_queued_requests": 1,
                                                         "served_model_name": "glm5-tiny-small"}},
    # tests/reliability: a 1280-token KV cache (4x overload = a handful of requests) + fault injection
    FAULTS_APP,
    # access control: an API key on /v1/*, request-level chat templates trusted (tests/serve/test_access.py)
    {"name": "secure", "route_prefix": "/secure", "args": {"api_key": SECURE_API_KEY, "trust_request_chat_template": True,
                                                           "max_num_seqs": 4, "kv_cache_memory_gb": 0.05,
                                                           "served_model_name": "glm5-tiny-secure"}},
    # no traffic until tests/deploy/test_first_scrape.py: its metric series must exist at 0 from the start
    # (the KV size in vLLM's spelling, as a serve config may give it, instead of the base config's GiB)
    {"name": "firstscrape", "route_prefix": "/firstscrape",
     "args": {"max_num_seqs": 2, "kv_cache_memory_gb": None, "kv_cache_memory_bytes": "16Mi",
              "served_model_name": "glm5-tiny-firstscrape"}},
    # two Router replicas behind the prefix-affinity request router (tests/serve/test_affinity_served.py)
    {"name": "affinity", "route_prefix": "/affinity",
     "args": {"router_replicas": 2, "request_router": "prefix_affinity", "max_num_seqs": 4,
              "kv_cache_memory_gb": 0.05, "served_model_name": "glm5-tiny-affinity"}},
]


@pytest.fixture(scope="session")
def serve_cluster(tmp_path_factory):
    from glm_ray.model.tiny import default_tiny_model
    from tests import cluster
    default_tiny_model()                       # write the cached tiny model once, before any replica
    tmp = tmp_path_factory.mktemp("serve")
    apps = list(EXTRA_APPS)
    from tests import flash_tiny
    if flash_tiny.available():                 # GLM-5.3-Flash at TP=2 (transformers writes the checkpoint)
        path = flash_tiny.write_flash_tiny(tmp / "glm53-flash-tiny")
        apps.append({"name": "flash", "route_prefix": "/flash",
                     "args": {"model": path, "tp": 2, "served_model_name": "glm53-flash-tiny-tp2"}})
    try:
        c = cluster.start(tmp, apps)
    except Exception:
        raise
    yield c
    cluster.stop(c.env)


@pytest.fixture(scope="session")
def tiny_server(serve_cluster):
    """The app of deploy/serve_config.yaml as deployed (tiny GLM-5, CPU, TP=1)."""
    return serve_cluster.apps["glm-ray"]


@pytest.fixture(scope="session")
def tp2_server(serve_cluster):
    return serve_cluster.apps["tp2"]


@pytest.fixture(scope="session")
def inrouter_server(serve_cluster):
    return serve_cluster.apps["inrouter"]


@pytest.fixture(scope="session")
def flash_server(serve_cluster):
    """Tiny GLM-5.3-Flash (glm5_next) served at TP=2; skipped where transformers has no glm5_next."""
    if "flash" not in serve_cluster.apps:
        pytest.skip("transformers has no glm5_next: no GLM-5.3-Flash checkpoint to serve")
    return serve_cluster.apps["flash"]
