"""Prefix-affinity routing vs Serve's default router, side by side: one local Ray serving the same model
twice — app "affinity" (`request_router: prefix_affinity`) and app "pow2" (`power_of_two`), two Router
replicas each — and the same `glm-ray bench --dataset-name generated-shared-prefix` workload against each,
interleaved (A B A B ...: a busy machine slows both alike), a new seed per repetition so every run starts
from prefixes no cache has seen. Reported per router: the prefix-cache hit rate over its two replicas (the
rise of `ray_glm_ray_prefix_cache_{hits,queries}_total` on Ray's metrics export during its runs) and TTFT /
throughput (the bench's result lines, averaged over the repetitions).

On CPU with the tiny model (the defaults; ~3 minutes on 2 cores):

    python -m glm_ray.bench.affinity
    python -m glm_ray.bench.affinity --app-arg kv_cache_memory_bytes=8Mi   # smaller caches

`--app-arg key=value` (repeatable) sets any ServeArgs field of both apps; without model= (or with
model=tiny) the apps run the tiny model on CPU with a 16 MiB KV cache per replica, otherwise ServeArgs'
defaults apply (e.g. `--app-arg model=glm5-flash-31b --app-arg load_format=dummy` on two GPUs). All four
replicas on one GPU: `--app-arg gpus_per_rank=0.25 --app-arg kv_cache_memory_bytes=16Gi` (each reserves a
quarter of it, with its own KV budget), and `--hit-source usage` where Ray's metrics agent does not run.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import ray
from ray import serve
from ray._private import ray_constants

from glm_ray.model.tiny import default_tiny_model
from glm_ray.serve.app import build_app

ROUTERS = {"affinity": "prefix_affinity", "pow2": "power_of_two"}     # app name -> request_router
#: the apps' arguments unless --app-arg names another model: a 16 MiB KV cache holds ~10k tiny-model tokens
TINY_CPU = {"model": "tiny", "device": "cpu", "max_num_seqs": 8, "kv_cache_memory_bytes": "16Mi"}
METRIC = re.compile(r'^ray_glm_ray_prefix_cache_(queries|hits)_total\{([^}]*)\} ([0-9.eE+-]+)$')
APP_LABEL = re.compile(r'application="([^"]*)"')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prefix_counters(metrics_port: int) -> dict[str, list[float]]:
    """{app: [queries, hits]} summed over the app's Router replicas, from Ray's metrics export."""
    out: dict[str, list[float]] = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    for line in text.splitlines():
        m = METRIC.match(line)
        app = APP_LABEL.search(m.group(2)) if m else None
        if app:
            out.setdefault(app.group(1), [0.0, 0.0])[m.group(1) == "hits"] += float(m.group(3))
    return out


def settled(metrics_port: int, app: str, at_least: float, timeout: float = 60) -> tuple[float, float]:
    """The app's (queries, hits) once Ray's export caught up: >= `at_least` queries, unchanged over 2 s."""
    deadline, last = time.time() + timeout, None
    while time.time() < deadline:
        cur = tuple(prefix_counters(metrics_port).get(app, (0.0, 0.0)))
        if cur == last and cur[0] >= at_least:
            return cur
        last = cur
        time.sleep(2)
    raise RuntimeError(f"{app}: the prefix-cache counters did not settle (last {last}, want >= {at_least} queries)")


def parse_app_args(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--app-arg {item!r}: expected key=value")
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--groups", type=int, default=8, help="--gsp-num-groups")
    p.add_argument("--prompts-per-group", type=int, default=8, help="--gsp-prompts-per-group")
    p.add_argument("--system-prompt-len", type=int, default=1024, help="--gsp-system-prompt-len")
    p.add_argument("--question-len", type=int, default=32, help="--gsp-question-len")
    p.add_argument("--output-len", type=int, default=8, help="--gsp-output-len")
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--repetitions", type=int, default=2, help="runs per router, interleaved")
    p.add_argument("--replicas", type=int, default=2, help="Router replicas per app")
    p.add_argument("--app-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="a ServeArgs field for both apps (default: the tiny model on CPU, max_num_seqs 8, a 16 MiB "
                        "KV cache per replica; another model= drops these defaults)")
    p.add_argument("--hit-source", choices=["metrics", "usage"], default="metrics",
                   help="prefix hit rate from Ray's metrics export (the replicas' counters), or from the responses' "
                        "usage.prompt_tokens_details.cached_tokens (where Ray's metrics agent does not run)")
    p.add_argument("--warmup-groups", type=int, default=0,
                   help="a discarded run of this many groups (other prefixes) per app before the measured ones")
    p.add_argument("--apps-in-turn", action="store_true",
                   help="deploy one app at a time (its warm-up and runs, then the other's) where the model fits "
                        "only one app's replicas at once, e.g. two GPU replicas on one GPU; not interleaved then")
    p.add_argument("--num-cpus", type=int, default=8, help="the local Ray's logical CPUs")
    p.add_argument("--workdir", default=None, help="bench results (default: a temporary directory)")
    args = p.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="glm-ray-affinity-"))
    workdir.mkdir(parents=True, exist_ok=True)

    # Ray's single-node mode, as `glm-ray serve`: GCS, raylet and metrics on 127.0.0.1 (the variable for the
    # processes ray.init starts, the constant for this one, which imported ray already)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    given = parse_app_args(args.app_arg)
    base = TINY_CPU if given.get("model", "tiny") == "tiny" else {}
    app_args = {**base, "served_model_name": "m", "router_replicas": args.replicas, **given}
    if app_args["model"] == "tiny":
        default_tiny_model()
    http_port, metrics_port = _free_port(), _free_port()
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, _metrics_export_port=metrics_port,
             _node_ip_address="127.0.0.1", _system_config={"metrics_report_interval_ms": 1000})
    rows: dict[str, list[dict]] = {app: [] for app in ROUTERS}
    counts = {app: [0.0, 0.0] for app in ROUTERS}
    prompt_tokens = args.groups * args.prompts_per_group * (args.system_prompt_len + args.question_len)

    def deploy(app: str) -> None:
        serve.run(build_app({**app_args, "request_router": ROUTERS[app]}), name=app, route_prefix=f"/{app}")

    def bench(app: str, groups: int, seed: int, out: Path) -> dict:
        subprocess.run(
            [sys.executable, "-m", "glm_ray.cli", "bench", "--base-url", f"http://127.0.0.1:{http_port}/{app}",
             "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(groups),
             "--gsp-prompts-per-group", str(args.prompts_per_group),
             "--gsp-system-prompt-len", str(args.system_prompt_len),
             "--gsp-question-len", str(args.question_len), "--gsp-output-len", str(args.output_len),
             "--max-concurrency", str(args.max_concurrency), "--seed", str(seed),
             "--warmup-requests", "0", "--tag", f"request_router={ROUTERS[app]}",
             "--output-file", str(out), "--no-plot"], check=True, stdout=sys.stderr)
        return json.loads(out.read_text().splitlines()[-1])

    def warm(app: str) -> None:
        """A discarded run of the same shape with other prefixes: first-use costs (kernel compiles, allocator
        growth) stay out of the measured runs."""
        bench(app, args.warmup_groups, 1000, workdir / f"warmup_{app}.jsonl")

    def run(app: str, rep: int) -> None:
        q0, h0 = settled(metrics_port, app, 0) if args.hit_source == "metrics" else (0.0, 0.0)
        rows[app].append(bench(app, args.groups, rep + 1, workdir / f"bench_{app}.jsonl"))
        if args.hit_source == "metrics":
            q1, h1 = settled(metrics_port, app, q0 + prompt_tokens)
        else:                       # every prompt token is a query; the cached ones are hits
            q1, h1 = float(rows[app][-1]["total_input_tokens"]), float(rows[app][-1].get("total_cached_tokens") or 0)
        counts[app][0] += q1 - q0
        counts[app][1] += h1 - h0

    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        if args.apps_in_turn:       # one app deployed at a time: A's runs, then B's (the models fit only twice)
            for app in ROUTERS:
                deploy(app)
                if args.warmup_groups:
                    warm(app)
                for rep in range(args.repetitions):
                    run(app, rep)
                serve.delete(app)
        else:
            for app in ROUTERS:
                deploy(app)
            for app in ROUTERS if args.warmup_groups else ():
                warm(app)
            for rep in range(args.repetitions):
                for app in ROUTERS:
                    run(app, rep)
    finally:
        serve.shutdown()
        ray.shutdown()

    ideal = (args.prompts_per_group - 1) * args.system_prompt_len / (
        args.prompts_per_group * (args.system_prompt_len + args.question_len))
    print(f"\ngenerated-shared-prefix: {args.groups} groups x {args.prompts_per_group} prompts, "
          f"{args.system_prompt_len}-token prefix + {args.question_len}-token question, {args.output_len} output "
          f"tokens, C={args.max_concurrency}; {args.replicas} Router replicas per app; {args.repetitions} "
          f"{'runs each, one app at a time' if args.apps_in_turn else 'interleaved runs each'}, means over runs (results: {workdir}); hit rate if each prefix is computed once: "
          f"{ideal:.1%}\n")
    print("| request_router | prefix hit rate | hits / queries (tokens) | mean TTFT (ms) | median TTFT (ms) | "
          "P99 TTFT (ms) | req/s |")
    print("|---|---|---|---|---|---|---|")
    for app, router in ROUTERS.items():
        q, h = counts[app]

        def mean(key, app=app):
            return statistics.fmean(r[key] for r in rows[app])
        print(f"| {router} | {h / q:.1%} | {h:.0f} / {q:.0f} | {mean('mean_ttft_ms'):.1f} | "
              f"{mean('median_ttft_ms'):.1f} | {mean('p99_ttft_ms'):.1f} | {mean('request_throughput'):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
