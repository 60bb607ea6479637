"""schemathesis over the app's own OpenAPI document (GET /openapi.json of "glm-ray").

The document must describe the real API: a JSON requestBody schema for every POST, the status
codes the server really answers (400, 404, 413, 503 ...; never 422), and schema-valid requests must
be accepted. Per operation: positive and negative cases (seeded), every response checked with
not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
response_headers_conformance, negative_data_rejection and positive_data_acceptance (see
harness.schemathesis_checks for the checks not run and why). Positive generation bodies are clamped
to a short generation (harness.clamp_positive_body: max_tokens <= 8, n <= 4), still schema-valid.
Nothing else is excluded."""
from __future__ import annotations

import json
import os

import pytest
import requests

from tests.reliability import harness as H

USES_CLUSTER = True
MAX_EXAMPLES = int(os.environ.get("GLM_RAY_SCHEMA_EXAMPLES", "8"))
SEED = int(os.environ.get("GLM_RAY_FUZZ_SEED", "0"))

OPERATIONS = ["GET /v1/models", "GET /v1/models/{model_id}", "GET /health", "GET /version", "POST /tokenize",
              "POST /detokenize", "POST /v1/completions", "POST /v1/chat/completions"]


@pytest.fixture(scope="module")
def schema_doc(main_app):
    r = requests.get(main_app.base_url + "/openapi.json", timeout=30)
    assert r.status_code == 200, r.text[:300]
    return r.json()


@pytest.fixture(scope="module")
def schema(main_app):
    return H.load_schema(main_app.base_url)


def test_openapi_describes_bodies_and_status_codes(schema_doc):
    problems = H.schema_problems(schema_doc)
    assert not problems, "the OpenAPI document does not describe the real API:\n" + "\n".join(problems)


def test_every_operation_is_tested(schema_doc):
    ops = {f"{m.upper()} {p}" for p, item in schema_doc["paths"].items() for m in item
           if m in ("get", "post", "put", "delete", "patch")}
    assert ops - set(OPERATIONS) == set(), f"operations this suite does not fuzz: {sorted(ops - set(OPERATIONS))}"


@pytest.mark.parametrize("operation", OPERATIONS)
def test_schemathesis(main_app, schema, schema_doc, operation):
    method, path = operation.split(" ", 1)
    if method.lower() not in schema_doc["paths"].get(path, {}):
        pytest.fail(f"{operation} is not in the OpenAPI document")
    out = H.run_schemathesis_operation(schema, main_app.base_url, operation, max_examples=MAX_EXAMPLES, seed=SEED,
                                       timeout=120)
    print(json.dumps({"cases": out["cases"], "notes": out["notes"]}))
    ok, detail = H.is_healthy(main_app.base_url, main_app.model)
    assert not out["failures"] and ok, \
        f"{operation}: {len(out['failures'])} failing checks (cases {out['cases']}):\n" + \
        "\n".join(f"- {k}: {json.dumps(v)[:700]}" for k, v in out["failures"].items()) + \
        f"\nalive after: {ok} {detail}"
