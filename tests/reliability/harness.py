"""The reliability harness, shared by the CI tests (tests/reliability/test_*.py) and the long run
(scripts/reliability.py): a seeded hostile-request generator, the response checker, and the scenario
runners (fuzz, 4x KV overload, disconnect storm, injected step faults, worker kill, soak), re-exported
here from client.py, hostile.py, scenarios.py and schema.py; the figures the long run prints are here.

Every request goes to 127.0.0.1 (the apps of tests/cluster.py); every loop is bounded in count and
in time. Each runner returns a plain dict (JSON-able) with its measured values; `figure()` turns
one into the line the long script prints (value, target, PASS/FAIL).

The contract checked (issue 15, "No request can take the server down"):
- no 5xx, except 503 that carries Retry-After (overload, engine restarting);
- 4xx/5xx bodies in OpenAI's shape {"error": {"message", "type", "param", "code"}}, one-line message;
  422 never (it is 400);
- no internals in any error text: tracebacks, ANSI escapes, Ray task/actor names and ids, pids, file
  paths, IP addresses;
- every response carries x-request-id; a 500 names it in its message;
- afterwards /health is 200 and a normal request succeeds.
"""
from __future__ import annotations

from dataclasses import dataclass

from tests.reliability.client import HostileRequest, Reply, check_reply, is_healthy, leaks, wait_healthy  # noqa: F401
from tests.reliability.hostile import HostileGenerator, run_fuzz, run_requests, summarize_fuzz  # noqa: F401
from tests.reliability.scenarios import (  # noqa: F401
    RayDriver,
    classify_generation,
    run_disconnect_storm,
    run_injected_fault,
    run_overload,
    run_soak,
    run_worker_kill,
)
from tests.reliability.schema import (  # noqa: F401
    CLAMP_TOKENS,
    clamp_positive_body,
    load_schema,
    run_schemathesis,
    run_schemathesis_operation,
    schema_problems,
)

# ------------------------------------------------------------------------------------------------
# Figures
# ------------------------------------------------------------------------------------------------


@dataclass
class Figure:
    name: str
    value: str
    target: str
    passed: bool

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'}  {self.name}: {self.value}  (target: {self.target})"

    def as_dict(self) -> dict:
        return {"name": self.name, "value": self.value, "target": self.target, "pass": self.passed}
