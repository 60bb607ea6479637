"""Hostile requests against the deployed app "glm-ray" (tests/reliability/harness.py): the fixed
catalog of every class of hostile input issue 15 lists (one test per class, each request with the
statuses that are right for it), then seeded random mutations of valid bodies for every endpoint.

Every response: no 5xx but a "busy" 503 + Retry-After (queue full, OOM: not an engine that is
down), 4xx/5xx in OpenAI's error shape with a one-line message, 422 never, no leaked internals, an
x-request-id; afterwards the app serves. A request after
which the app stopped serving is named as such (the runner waits for the app to serve again, so
the requests after it are judged on their own)."""
from __future__ import annotations

import os

import pytest

from tests.reliability import harness as H

USES_CLUSTER = True
SEED = int(os.environ.get("GLM_RAY_FUZZ_SEED", "0"))
MUTATIONS = int(os.environ.get("GLM_RAY_FUZZ_MUTATIONS", "300"))

# the classes of the catalog (kind prefix before the first ':'), e.g. "nan", "nesting", "surrogate"
GROUPS = sorted({r.kind.split(":")[0] for r in H.HostileGenerator(0, "m", 1024, 4096).catalog()})


def _report(results) -> str:
    lines = []
    for req, reply, problems in results:
        if problems:
            resp = reply.text[:240] if reply.status is not None else reply.transport_error
            lines.append(f"{req.describe(120)}\n    -> {reply.status}: {resp!r}\n    problems: {problems}")
    return "\n".join(lines)


@pytest.mark.parametrize("group", GROUPS)
def test_hostile_catalog(main_app, group):
    gen = H.HostileGenerator(SEED, main_app.model, main_app.vocab_size, main_app.max_model_len)
    reqs = [r for r in gen.catalog() if r.kind.split(":")[0] == group]
    results = H.run_requests(main_app.base_url, main_app.model, reqs, concurrency=1, timeout=120)
    assert len(results) == len(reqs), "the app stopped serving and did not come back"
    bad = _report(results)
    ok, detail = H.is_healthy(main_app.base_url, main_app.model)
    assert not bad and ok, f"{sum(1 for r in results if r[2])}/{len(reqs)} {group} requests wrong:\n{bad}\n" \
                           f"alive after: {ok} {detail}"


def test_seeded_mutations(main_app):
    gen = H.HostileGenerator(SEED, main_app.model, main_app.vocab_size, main_app.max_model_len)
    n_cat = len(gen.catalog())
    reqs = gen.requests(n_cat + MUTATIONS)[n_cat:]          # past the catalog: the random part only
    results = H.run_requests(main_app.base_url, main_app.model, reqs, concurrency=4, timeout=120,
                             deadline_s=240)
    summary = H.summarize_fuzz(results, H.is_healthy(main_app.base_url, main_app.model))
    print({k: v for k, v in summary.items() if k != "failures"})
    assert len(results) == len(reqs), f"only {len(results)}/{len(reqs)} sent within the time bound"
    assert summary["failed_requests"] == 0 and summary["alive_after"], \
        f"{summary['failed_requests']}/{len(reqs)} wrong (seed {SEED}); statuses {summary['statuses']}; " \
        f"alive after: {summary['alive_detail']}\n{_report(results)[:20000]}"
