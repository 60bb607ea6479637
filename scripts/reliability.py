#!/usr/bin/env python
"""The long reliability run of issue 15 ("No request can take the server down"): starts its own
local cluster (tests/cluster.py: `ray start --head` + `serve deploy`, 127.0.0.1 only) with the tiny
app "glm-ray" and the fault-injection app "faults" (tests/reliability/apps.py), runs every scenario
of tests/reliability/harness.py, prints one line per figure (measured value, target, PASS/FAIL),
writes them as JSON, and stops the cluster.

    .venv/bin/python scripts/reliability.py --fuzz-requests 10000 --soak-minutes 20 \\
        --json docs/measurements/<date>/reliability.json
    .venv/bin/python scripts/reliability.py --fuzz-requests 500 --soak-minutes 1      # a short run

Figures (targets):
  fuzz          N fuzzed requests (the hostile catalog, then seeded mutations): 0 x 5xx (503 with
                Retry-After of a busy server excepted), server alive, no leaked internals; + statuses vs
                the contract
  schemathesis  positive + negative cases over the app's OpenAPI document: 0 failing checks
  overload      4x the KV capacity at once ("faults", 1280 tokens): 0 lost (each request completes
                or gets a clean 429/503)
  disconnects   100 clients gone mid-stream: running, waiting and KV back to 0 within 2 s
  faults        an exception / an OOM in a step's forward, an exception in the sampler: only the
                affected requests fail, /health stays 200, the KV is freed
  soak          steady load: 0 errors, RSS growth < 5% and flat open fds of the Router, TP worker,
                ingress and proxy processes (psutil)
  worker kill   the TP worker killed mid-stream: 503 within 1 s, serving again within 60 s
Exit status: 0 when every figure passes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests import cluster as C  # noqa: E402
from tests.reliability import harness as H  # noqa: E402
from tests.reliability.apps import FAULTS_APP  # noqa: E402

SCENARIOS = ["fuzz", "schemathesis", "overload", "disconnects", "faults", "soak", "worker_kill"]
FD_TOLERANCE = 8          # "flat": at most this many more open fds at the end than at the start, per process


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _fmt_s(x) -> str:
    return "n/a" if x is None else f"{x:.2f} s"


def fuzz_figures(r: dict) -> list[H.Figure]:
    alive = "alive" if r["alive_after"] else "NOT serving after the run"
    sent = f"{r['requests']} of {r['planned']} sent" if r["requests"] != r["planned"] else f"{r['requests']}"
    return [
        H.Figure("fuzz", f"{sent} fuzzed requests: {r['server_errors']} x 5xx, {r['transport_errors']} without "
                 f"response, {r['leaks']} leaking internals, {alive}",
                 "0 x 5xx (a busy 503 + Retry-After excepted), alive, 0 leaks",
                 r["server_errors"] == 0 and r["leaks"] == 0 and r["transport_errors"] == 0 and r["alive_after"]
                 and r["requests"] == r["planned"]),
        H.Figure("fuzz contract", f"{r['wrong_status']} wrong statuses, {r['bad_shape']} bad error shapes/headers "
                 f"(statuses {r['statuses']})", "0 / 0", r["wrong_status"] == 0 and r["bad_shape"] == 0),
    ]


def schemathesis_figures(r: dict) -> list[H.Figure]:
    failing = [f"{o['operation']} {k}" for o in r["operations"] for k in o["failures"]]
    return [H.Figure("schemathesis", f"{r['cases']} cases over {len(r['operations'])} operations: "
                     f"{len(failing)} failing checks, {len(r['schema_problems'])} schema gaps",
                     "0 failing checks, 0 gaps", not failing and not r["schema_problems"])]


def overload_figures(r: dict) -> list[H.Figure]:
    return [H.Figure("overload", f"{r['factor']}x KV ({r['requests']} requests, {r['tokens_requested']} tokens vs "
                     f"{r['kv_capacity_tokens']} KV tokens): {r['completed']} completed, {r['rejected']} clean "
                     f"429/503, {r['lost']} lost; KV back to 0: {r['idle_after_s'] is not None}",
                     "0 lost", r["lost"] == 0 and r["idle_after_s"] is not None and r["factor"] >= 4.0)]


def disconnect_figures(r: dict) -> list[H.Figure]:
    return [H.Figure("disconnects", f"{r['mid_stream_disconnects']}/{r['streams']} clients gone mid-stream: "
                     f"running/waiting/KV back to 0 after {_fmt_s(r['drain_s'])}",
                     "all mid-stream, <= 2 s",
                     r["mid_stream_disconnects"] == r["streams"] and r["drain_s"] is not None and r["drain_s"] <= 2.0)]


def fault_figures(rs: list[dict]) -> list[H.Figure]:
    out = []
    for r in rs:
        value = (f"poisoned -> {r['poisoned_status']} {r['poisoned_code']}; same-step bystanders: "
                 f"{r['bystanders_failed_clean']} failed cleanly, {r['bystanders_ok']} finished of {r['bystanders']}; "
                 f"later {r['later_ok']}/{r['later']} OK; /health non-200 {r['health_bad']}/{r['health_checks']}")
        if r["problems"]:
            value += f"; {len(r['problems'])} problems: {r['problems'][0][:160]}"
        out.append(H.Figure(f"injected {r['kind']}", value, "only the affected requests fail", not r["problems"]))
    return out


def soak_figures(r: dict) -> list[H.Figure]:
    procs = r["processes"]
    worst = max(((v.get("rss_growth", float("inf")), k) for k, v in procs.items()), default=(None, "-"))
    worst_fd = max(((v.get("fds_end", 0) - v.get("fds_start", 0), k) for k, v in procs.items() if "fds_end" in v),
                   default=(None, "-"))
    return [
        H.Figure("soak", f"{r['minutes']} min at {r['concurrency']} clients: {r['errors']} errors in "
                 f"{r['requests']} requests", "0 errors", r["errors"] == 0 and r["requests"] > 0),
        H.Figure("soak RSS", f"max growth {worst[0]:.2%} ({worst[1]}) over {len(procs)} processes"
                 if worst[0] is not None and worst[0] != float("inf") else f"unmeasured: {procs}",
                 "< 5% per process", r["all_processes_sampled"] and r["max_rss_growth"] is not None
                 and r["max_rss_growth"] < 0.05),
        H.Figure("soak fds", f"max growth {worst_fd[0]} fds ({worst_fd[1]})", f"flat (<= +{FD_TOLERANCE})",
                 r["all_processes_sampled"] and r["max_fd_growth"] is not None and r["max_fd_growth"] <= FD_TOLERANCE),
    ]


def kill_figures(r: dict) -> list[H.Figure]:
    return [
        H.Figure("worker kill: 503", f"first 503 {_fmt_s(r['first_503_s'])} after killing {r['workers_killed']} "
                 f"worker(s); {r['streams_ended_with_error_event']}/{r['streams_running_at_kill']} in-flight streams "
                 f"ended with an error event; {r['bad_during_outage_count']} answers other than 503 + Retry-After",
                 "<= 1 s, every stream ends cleanly, only 503 + Retry-After",
                 r["first_503_s"] is not None and r["first_503_s"] <= 1.0 and r["bad_during_outage_count"] == 0
                 and r["streams_ended_with_error_event"] == r["streams_running_at_kill"] == r["streams"]
                 and r["streams_leaking"] == 0),
        H.Figure("worker kill: recovery", f"serving again after {_fmt_s(r['recovered_s'])}", "<= 60 s",
                 r["recovered_s"] is not None and r["recovered_s"] <= 60.0),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fuzz-requests", type=int, default=10_000)
    ap.add_argument("--fuzz-concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--schema-examples", type=int, default=25, help="schemathesis examples per operation and mode")
    ap.add_argument("--overload-factor", type=float, default=4.0)
    ap.add_argument("--disconnects", type=int, default=100)
    ap.add_argument("--soak-minutes", type=float, default=20.0)
    ap.add_argument("--soak-concurrency", type=int, default=4)
    ap.add_argument("--kill-streams", type=int, default=4)
    ap.add_argument("--only", default=",".join(SCENARIOS), help=f"comma-separated subset of {SCENARIOS}")
    ap.add_argument("--json", type=Path, help="write the figures and raw results here")
    args = ap.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(SCENARIOS)
    if unknown:
        ap.error(f"unknown scenarios {sorted(unknown)}")

    from glm_ray.model.tiny import default_tiny_model
    default_tiny_model()
    t_start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="glm-ray-reliability-"))
    print(f"[reliability] starting a local cluster (apps glm-ray, faults) in {tmp} ...", flush=True)
    cluster = C.start(tmp, [FAULTS_APP])
    main_app, faults = cluster.apps["glm-ray"], cluster.apps["faults"]
    print(f"[reliability] up in {time.monotonic() - t_start:.0f}s: {cluster.http_port=}", flush=True)
    figures: list[H.Figure] = []
    results: dict = {}

    def scenario(name: str, app, fn, to_figures):
        if name not in only:
            return
        try:
            waited = H.wait_healthy(app.base_url, app.model, timeout=240)
            t0 = time.monotonic()
            print(f"[reliability] {name} ...", flush=True)
            r = fn()
            results[name] = r if isinstance(r, dict) else {"runs": r}
            if isinstance(results[name], dict):
                results[name]["scenario_seconds"] = round(time.monotonic() - t0, 1)
                results[name]["waited_for_app_s"] = round(waited, 1)
            figs = to_figures(r)
        except Exception as e:  # noqa: BLE001  (a scenario that cannot run is a failed figure, the others go on)
            results[name] = {"error": repr(e), "traceback": traceback.format_exc()}
            figs = [H.Figure(name, f"did not run: {e!r}"[:300], "runs", False)]
        for f in figs:
            print("  " + f.line(), flush=True)
        figures.extend(figs)

    try:
        with H.RayDriver(cluster.gcs_address, cluster.dashboard_url) as rd:
            scenario("fuzz", main_app, lambda: H.run_fuzz(
                main_app.base_url, main_app.model, main_app.vocab_size, main_app.max_model_len, args.fuzz_requests,
                seed=args.seed, concurrency=args.fuzz_concurrency, timeout=120,
                deadline_s=max(600.0, args.fuzz_requests * 0.5)), fuzz_figures)
            scenario("schemathesis", main_app, lambda: H.run_schemathesis(
                main_app.base_url, max_examples=args.schema_examples, seed=args.seed, timeout=120),
                schemathesis_figures)
            scenario("overload", faults, lambda: H.run_overload(
                faults.base_url, faults.model, rd, "faults", faults.max_model_len, factor=args.overload_factor,
                seed=args.seed, timeout=600), overload_figures)
            scenario("disconnects", main_app, lambda: H.run_disconnect_storm(
                main_app.base_url, main_app.model, rd, "glm-ray", n=args.disconnects, chunks=3, max_tokens=1000,
                seed=args.seed, budget_s=300), disconnect_figures)
            scenario("faults", faults, lambda: [H.run_injected_fault(
                faults.base_url, faults.model, rd, "faults", kind, seed=args.seed, timeout=120)
                for kind in ("exception", "oom", "sample")], fault_figures)
            scenario("soak", main_app, lambda: H.run_soak(
                {"glm-ray": (main_app.base_url, main_app.model)}, rd, args.soak_minutes,
                concurrency=args.soak_concurrency, seed=args.seed), soak_figures)
            # last: it takes the app's engine down (Serve replaces the replica)
            scenario("worker_kill", main_app, lambda: H.run_worker_kill(
                main_app.base_url, main_app.model, rd, "glm-ray", main_app.max_model_len,
                streams=args.kill_streams), kill_figures)
    finally:
        C.stop(cluster.env)

    passed = all(f.passed for f in figures)
    print("\n=== reliability figures " + "=" * 60)
    for f in figures:
        print(f.line())
    print(f"=== {sum(f.passed for f in figures)}/{len(figures)} PASS; {time.monotonic() - t_start:.0f}s in all")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "git_commit": _git_commit(), "argv": sys.argv[1:], "args": {k: str(v) for k, v in vars(args).items()},
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
               "passed": passed, "figures": [f.as_dict() for f in figures], "results": results}
        args.json.write_text(json.dumps(doc, indent=1, default=str))
        print(f"[reliability] wrote {args.json}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
