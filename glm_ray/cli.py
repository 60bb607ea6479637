"""`glm-ray` command line: serve | generate | make-tiny | quantize | bench | eval."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import time

from glm_ray import __version__, envs
from glm_ray.bench import cli as bench_cli
from glm_ray.engine.sampling_params import SamplingParams
from glm_ray.eval import cli as eval_cli
from glm_ray.model import quantize
from glm_ray.model.tiny import bundled_config, default_tiny_model, write_tiny
from glm_ray.serve import args as serve_args
from glm_ray.serve import proxy_middleware
from glm_ray.serve.args import ServeArgs

SERVE_SCOPES = (serve_args.ENGINE, serve_args.APP)     # every ServeArgs field is a `serve` flag
GENERATE_SCOPES = (serve_args.ENGINE,)                 # `generate`: the engine's
# Ray's metrics export interval for the Ray `glm-ray serve` starts (Ray's default: 10 s, by which the
# running/KV gauges on /metrics trail the engine): the cost is one export per Ray process per interval
METRICS_REPORT_INTERVAL_MS = 2000


class _HelpFormatter(argparse.HelpFormatter):
    """Shows every option's default (argparse's ArgumentDefaultsHelpFormatter, minus `None`/`False`)."""

    def _get_help_string(self, action):
        help = action.help or ""
        if ("%(default)" not in help and action.default is not None and action.default is not False
                and action.default != argparse.SUPPRESS
                and (action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE))):
            help += " (default: %(default)s)"
        return help


def cmd_make_tiny(a) -> int:
    cfg = bundled_config(a.config) if a.config and not os.path.isfile(a.config) else None
    if a.config and os.path.isfile(a.config):
        with open(a.config) as f:
            cfg = json.load(f)
    if a.quant == "bf16":
        out = write_tiny(a.dir, cfg, seed=a.seed)
    else:
        out = quantize.make_tiny_quantized(a.dir, a.quant, cfg, seed=a.seed)
    print(f"wrote {out}")
    return 0


def cmd_generate(a) -> int:
    from glm_ray.llm import LLM  # noqa: PLC0415 - deferred: ray (the executor)
    sa = ServeArgs.from_dict(serve_args.values_from_flags(a, GENERATE_SCOPES))
    llm = LLM(sa.model, **sa.engine_kwargs())
    tok = llm.get_tokenizer()
    prompts = a.prompt or ["Hello, my name is"]
    if a.chat and tok is not None:
        prompts = [{"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content": p}],
                                                                add_generation_prompt=True, tokenize=True,
                                                                return_dict=False)} for p in prompts]
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                        seed=a.seed, ignore_eos=a.ignore_eos)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = 0
    for o in outs:
        c = o.outputs[0]
        n += len(c.token_ids)
        shown = o.prompt if o.prompt is not None else f"<{len(o.prompt_token_ids)} tokens>"
        print(f"prompt: {shown!r}\noutput: {c.text!r}  ({len(c.token_ids)} tokens, finish_reason={c.finish_reason})")
    print(f"{n} tokens in {dt:.2f}s ({n / dt:.1f} tok/s)")
    return 0


def serve_app_args(a) -> dict:
    """The `build_app` arguments (ServeArgs) of `glm-ray serve`'s flags: the settings given (the rest are
    ServeArgs' defaults, environment fallbacks included) and the model."""
    return {"model": "tiny", **serve_args.values_from_flags(a, SERVE_SCOPES)}


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _is_loopback(ip: str) -> bool:
    return ip in ("localhost", "::1") or ip.startswith("127.")


def _url_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to `host`."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _throughput_optimized(a, sa) -> None:
    """Ray Serve's throughput-optimized mode for the local Ray `cmd_serve` starts: the variables every Ray process
    reads at import (so set before the first ray import), the ingress replica's HTTP port = --port (Ray allocates
    direct-ingress ports from [RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT, ..._MAX_HTTP_PORT)), and replica logs kept on the console as
    in the default mode. Serve's proxy (still started on the head node) moves to `_free_port` (after ray.init)."""
    if a.address:
        raise SystemExit("--throughput-optimized configures the local Ray; on a cluster set "
                         "RAY_SERVE_THROUGHPUT_OPTIMIZED=1 and RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT on every node")
    if sa.ingress_replicas != 1:
        raise SystemExit("--throughput-optimized serves --port from the one ingress replica: --ingress-replicas 1")
    os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = "1"
    # the replica's port range [min, max) = exactly --port: taken, the deployment fails with NoAvailablePortError
    # instead of serving on a port nobody was told about
    os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] = str(a.port)
    os.environ["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"] = str(a.port + 1)
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "1")


def _free_port(host: str) -> int:
    """A port free on `host` now, off the replica's: probed just before Serve's proxy binds it, after ray.init
    (Ray's own processes take ephemeral ports while they start: a CI run once saw the proxy's port, probed
    before ray.init, taken by then)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def cmd_serve(a) -> int:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    app_args = serve_app_args(a)
    sa = ServeArgs.from_dict(app_args)          # bad flags fail here, before Ray starts
    loopback = not a.address and _is_loopback(a.ray_node_ip)
    if a.throughput_optimized:
        _throughput_optimized(a, sa)
    # the proxy's request-id guard (serve/proxy_middleware.py), read by the proxy actor Ray starts here
    os.environ.setdefault(proxy_middleware.ENV, proxy_middleware.IMPORT_PATH)
    if loopback:
        # NOTE: on Linux Ray swaps a loopback node IP for the host's reachable IP, and its gRPC servers
        # (GCS, raylet, workers) then listen on every interface. Ray's single-node mode (its default on
        # macOS/Windows) keeps 127.0.0.1 as the node IP, and with it every Ray port on loopback. Ray
        # reads the variable at import, in this process and in every process it starts.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    # ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at import: every ray import comes after the line above
    import ray  # noqa: PLC0415 - after the loopback setting above
    if loopback:
        from ray._private import ray_constants  # noqa: PLC0415 - after the loopback setting above
        ray_constants.ENABLE_RAY_CLUSTER = False    # in case something imported ray before the line above
    from ray import serve  # noqa: PLC0415 - after the loopback setting above

    from glm_ray.serve.app import build_app  # noqa: PLC0415 - imports ray, after the loopback setting above
    if sa.model == "tiny":                      # write the cache once here, not in two replicas at once
        default_tiny_model()
    if a.address:
        ray.init(address=a.address)
    else:
        # NOTE: a local Ray binds GCS, raylet, object manager and the metrics export to --ray-node-ip
        # (loopback by default), whatever --host the HTTP API binds to; no dashboard.
        ray.init(address="local", include_dashboard=False, _metrics_export_port=a.metrics_port,
                 num_cpus=a.num_cpus, _node_ip_address=a.ray_node_ip,
                 _system_config={"metrics_report_interval_ms": a.metrics_report_interval_ms})
    signal.signal(signal.SIGTERM, _raise_interrupt)     # `kill PID` stops as cleanly as Ctrl-C
    try:
        proxy_port = _free_port(a.host) if a.throughput_optimized else a.port
        serve.start(http_options={"host": a.host, "port": proxy_port})
        serve.run(build_app(app_args), name="glm-ray", route_prefix="/", blocking=False)
        url = f"http://{_url_host(a.host)}:{a.port}"
        metrics_host = _url_host(a.ray_node_ip) if not a.address else "<each node>"
        try:
            logs = ray._private.worker._global_node.get_logs_dir_path()
        except Exception:  # noqa: BLE001 - private Ray API, only for a hint: fall back to the default path
            logs = "/tmp/ray/session_latest/logs"
        auth = ("required: Authorization: Bearer <key> on /v1/* (from --api-key / GLM_RAY_API_KEY)"
                if sa.api_key else "off (set --api-key or GLM_RAY_API_KEY to require one)")
        print(f"\nglm-ray {__version__} is serving model {sa.model_name()!r} "
              f"(from {sa.model!r}, tp={sa.tp}; clients send \"model\": \"{sa.model_name()}\")\n"
              f"  OpenAI API : {url}/v1   (bound to {a.host}; e.g. curl {url}/v1/models)\n"
              + (f"  serving    : throughput-optimized: the ingress replica on :{a.port} (direct ingress), "
                 f"Serve's proxy on :{proxy_port}\n" if a.throughput_optimized else "") +
              f"  API key    : {auth}\n"
              f"  metrics    : http://{metrics_host}:{a.metrics_port}/metrics   (grep ray_glm_ray)\n"
              f"  logs       : {logs}   (serve/ = the app's replicas)\n"
              f"Ctrl-C (or kill {os.getpid()}) to stop.", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        # a second Ctrl-C / SIGTERM (a supervisor repeating its signal) must not cut the shutdown short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("stopping glm-ray ...", flush=True)
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glm-ray", description=__doc__)
    parser.add_argument("--version", action="version", version=f"glm-ray {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="{serve,generate,make-tiny,quantize,bench,eval}")

    p = sub.add_parser("serve", help="start a local Ray + the OpenAI-compatible app (Ctrl-C stops both)",
                       description="Start a local Ray (or join one with --address) and serve the "
                                   "OpenAI-compatible app on it. Ctrl-C stops both.",
                       formatter_class=_HelpFormatter)
    serve_args.add_flags(p, SERVE_SCOPES)
    p.add_argument("--host", default="127.0.0.1",
                   help="address the HTTP API binds to (0.0.0.0: every interface; Ray itself stays on "
                        "--ray-node-ip)")
    p.add_argument("--port", type=int, default=8000, help="port of the HTTP API")
    p.add_argument("--metrics-port", type=int, default=8080,
                   help="Ray's Prometheus export port (our metrics are ray_glm_ray_*)")
    p.add_argument("--metrics-report-interval-ms", type=int, default=METRICS_REPORT_INTERVAL_MS,
                   help="how often every Ray process exports its metrics to the export port (Ray's "
                        "metrics_report_interval_ms; Ray's own default is 10000): a gauge change shows on "
                        "/metrics within about this long. A setting of the Ray cluster: with --address, the "
                        "cluster's own (RAY_metrics_report_interval_ms at its `ray start`) applies")
    p.add_argument("--ray-node-ip", default="127.0.0.1",
                   help="IP the local Ray's GCS, raylet, object manager and metrics export bind to "
                        "(a reachable IP only when other nodes must join)")
    p.add_argument("--address", default=None,
                   help="join an existing Ray cluster (e.g. 127.0.0.1:6379, or auto) instead of starting one")
    p.add_argument("--num-cpus", type=int, default=None,
                   help="CPUs the local Ray may schedule on (default: all of this machine's)")
    p.add_argument("--throughput-optimized", action="store_true",
                   help="Ray Serve's throughput-optimized mode (Ray 2.60, RAY_SERVE_THROUGHPUT_OPTIMIZED=1; "
                        "experimental there): the ingress replica serves HTTP itself on --port (direct "
                        "ingress: Serve's proxy no longer relays every chunk and moves to a free port), "
                        "deployments call each other over gRPC, replica code runs on its event loop, GC is "
                        "frozen after start. A local Ray with one ingress replica only; on a cluster set the "
                        "variables on every node (README, 'Serving')")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="offline generation with the LLM API (no server)",
                       formatter_class=_HelpFormatter)
    serve_args.add_flags(p, GENERATE_SCOPES)
    p.add_argument("--prompt", action="append", help="a prompt; repeatable (default: 'Hello, my name is')")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=-1, help="-1 = off")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: unseeded)")
    p.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens tokens even past EOS")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("make-tiny", help="write a tiny random GLM-5 checkpoint in the real on-disk format",
                       formatter_class=_HelpFormatter)
    p.add_argument("dir", help="output directory")
    p.add_argument("--config", default=None,
                   help="a config.json path or a bundled config name, e.g. glm53-flash-tiny-text.json "
                        "(default: glm5-tiny.json)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--quant", default="bf16", choices=["bf16", "fp8", "mxfp4"],
                   help="fp8: DeepSeek-style block FP8; mxfp4: Quark MXFP4 experts + block-FP8 MTP layer")
    p.set_defaults(func=cmd_make_tiny)

    quantize.add_parser(sub)
    bench_cli.add_parser(sub)
    eval_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=envs.LOG_LEVEL.get(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = build_parser().parse_args(argv)
    return a.func(a) or 0


if __name__ == "__main__":
    sys.exit(main())
