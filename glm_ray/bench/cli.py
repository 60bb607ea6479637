"""`glm-ray bench`: command-line front end of the serving benchmark.

Owns the flags and the three modes; the work is done by `client` (load + timings), `metrics`
(definitions) and `report` (tables, JSONL, plots).

  run      glm-ray bench --base-url http://127.0.0.1:8000 --input-len 1024 --output-len 1024 \\
               --concurrency 4 8 16 32 64 --repetitions 3 --label fp8_proj=off
  compare  glm-ray bench --compare off.jsonl on.jsonl       (PR B delta table, B vs A)
  report   glm-ray bench --report off.jsonl [more.jsonl...] (table + plots from saved results)

`add_parser(subparsers)` adds the ``bench`` subcommand to a parent CLI (it sets ``func=run``);
``python -m glm_ray.bench.cli`` runs it standalone. Exit status: 0 ok, 1 some request failed
(or, with --strict, a consistency check failed), 2 usage error or server unreachable.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from glm_ray.bench import metrics, report

DEFAULT_CONCURRENCIES = (4, 8, 16, 32, 64)


def _rate(text: str) -> float:
    v = float(text)
    if v <= 0 or math.isnan(v):
        raise argparse.ArgumentTypeError("request rate must be > 0 (or inf)")
    return v


def _positive_int(text: str) -> int:
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError("must be a positive integer")
    return v


def _int_list(text: str) -> list[int]:
    return [int(x) for x in re.split(r"[,\s]+", text.strip()) if x]


def _add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="OpenAI-compatible server (ours, vLLM, SGLang); default %(default)s")
    g.add_argument("--model", default=None, help="model name to send (default: first id of GET /v1/models)")
    g.add_argument("--endpoint", default="/v1/completions", help="streaming completions path (default %(default)s)")
    g.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="fail a request after S seconds without data (default %(default)s)")
    g.add_argument("--usage-per-chunk", choices=("auto", "on", "off"), default="auto",
                   help="ask for stream_options.continuous_usage_stats to count tokens per chunk exactly; "
                        "auto falls back when the server refuses it (default %(default)s)")
    g.add_argument("--extra-body", default=None, metavar="JSON",
                   help="JSON object merged into every request body")

    g = p.add_argument_group("workload")
    g.add_argument("--input-len", type=_positive_int, default=1024, help="prompt tokens (default %(default)s)")
    g.add_argument("--output-len", type=_positive_int, default=1024, help="output tokens, ignore_eos (default %(default)s)")
    g.add_argument("--range-ratio", type=float, default=1.0,
                   help="sglang's law: lengths uniform in [max(int(L*r),1), L]; 1.0 = fixed lengths "
                        "(default %(default)s; note sglang's own default is 0.0)")
    g.add_argument("--concurrency", type=_positive_int, nargs="+", default=list(DEFAULT_CONCURRENCIES),
                   metavar="C", help="max-concurrency sweep (default %(default)s)")
    g.add_argument("--prompts-per-concurrency", type=_positive_int, default=4, metavar="K",
                   help="num-prompts = K x C (default %(default)s)")
    g.add_argument("--num-prompts", type=_positive_int, default=None,
                   help="fixed number of prompts per run (overrides --prompts-per-concurrency)")
    g.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="requests/s, Poisson arrivals; inf sends all at once under the semaphore (default inf)")
    g.add_argument("--warmup-requests", type=int, default=1, help="warm-up requests before each run (default %(default)s)")
    g.add_argument("--warmup-output-len", type=_positive_int, default=32, help="output tokens of warm-up requests")
    g.add_argument("--warmup-pause", type=float, default=1.0, metavar="S", help="pause after warm-up (default %(default)s)")
    g.add_argument("--repetitions", type=_positive_int, default=1, help="runs per concurrency (origin PR B: 3)")
    g.add_argument("--seed", type=int, default=42)
    g.add_argument("--vocab-size", type=_positive_int, default=None,
                   help="token ids are drawn from [0, V) (default: the server's vocab_size if /v1/models "
                        "advertises one, else 1024; use 154880 for GLM-5 / GLM-4.7-Flash)")
    g.add_argument("--exclude-token-ids", type=_int_list, default=[], metavar="IDS",
                   help="comma-separated ids never to put in prompts (special tokens)")

    g = p.add_argument_group("output")
    g.add_argument("--label", default="", help='tag stored with every result, e.g. "fp8_proj=off"')
    g.add_argument("--result-file", default=None, metavar="PATH",
                   help="JSONL to append one line per run to (default bench-results/<time>_<label>_<in>x<out>.jsonl)")
    g.add_argument("--save-requests", action="store_true",
                   help="also write per-request raw timings to <result stem>_requests.jsonl")
    g.add_argument("--no-plot", action="store_true", help="skip the PNG plots")
    g.add_argument("--plot-prefix", default=None, metavar="PREFIX",
                   help="write PREFIX_latency.png and PREFIX_throughput.png (default: next to the results)")
    g.add_argument("--format", choices=("text", "markdown", "tsv"), default="text", help="table format")
    g.add_argument("--aggregate", choices=("mean", "median"), default="mean", help="combine repetitions by")
    g.add_argument("--drop-outlier", action="store_true",
                   help="with >= 3 reps, drop the run furthest from the median output tok/s per point")
    g.add_argument("--tolerance", type=float, default=0.05, help="relative tolerance of the consistency checks")
    g.add_argument("--strict", action="store_true", help="exit 1 when a consistency check fails")
    g.add_argument("--detail", action="store_true", help="print the full sglang-style block after every run")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")

    g = p.add_argument_group("saved results")
    g.add_argument("--compare", nargs=2, metavar=("A.jsonl", "B.jsonl"), default=None,
                   help="print the delta table of B vs A (e.g. fp8_proj off vs on) and exit")
    g.add_argument("--report", nargs="+", metavar="FILE.jsonl", default=None,
                   help="print the table (and plots unless --no-plot) of saved results and exit")


def build_parser(prog: str = "glm-ray bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Serving benchmark comparable with sglang.bench_serving.")
    _add_arguments(p)
    return p


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to an argparse subparsers object; sets ``func=run``."""
    p = subparsers.add_parser(
        "bench", help="serving benchmark against an OpenAI-compatible server (sglang.bench_serving-style)",
        description="Serving benchmark comparable with sglang.bench_serving: random token-id prompts, "
                    "ignore_eos, greedy, a max-concurrency sweep; TTFT/TPOT/ITL/E2EL and throughput.")
    _add_arguments(p)
    p.set_defaults(func=run)
    return p


# ----------------------------------------------------------------------------------------------

def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "-", text).strip("-") or "run"


def _print(*parts: Any) -> None:
    print(*parts, flush=True)


def _err(msg: str) -> None:
    print(f"glm-ray bench: error: {msg}", file=sys.stderr, flush=True)


def _plots(series, prefix: str, title: str) -> None:
    try:
        paths = report.write_plots(series, prefix, title)
    except ImportError:
        _err("matplotlib is not installed; no plots (pip install matplotlib)")
        return
    _print("plots: " + ", ".join(str(p) for p in paths))


def _run_compare(args) -> int:
    a_path, b_path = args.compare
    try:
        rows_a, rows_b = report.load_jsonl(a_path), report.load_jsonl(b_path)
    except (OSError, ValueError) as e:
        _err(str(e))
        return 2
    _print(report.format_compare_report(rows_a, rows_b, name_a=Path(a_path).stem, name_b=Path(b_path).stem,
                                        fmt=args.format, how=args.aggregate, drop_outlier=args.drop_outlier))
    if args.plot_prefix and not args.no_plot:
        la, lb = report.label_of(rows_a, Path(a_path).stem), report.label_of(rows_b, Path(b_path).stem)
        if la == lb:
            la, lb = f"A: {la}", f"B: {lb}"
        series = {la: report.aggregate(rows_a, args.aggregate, args.drop_outlier),
                  lb: report.aggregate(rows_b, args.aggregate, args.drop_outlier)}
        _plots(series, args.plot_prefix, f"{la} vs {lb}")
    return 0


def _run_report(args) -> int:
    series = {}
    for path in args.report:
        try:
            rows = report.load_jsonl(path)
        except (OSError, ValueError) as e:
            _err(str(e))
            return 2
        agg = report.aggregate(rows, args.aggregate, args.drop_outlier)
        _print(f"{path}: {report.describe_rows(rows)}")
        _print(report.format_table(agg, args.format))
        _print(report.table_footer(agg, args.aggregate) + "\n")
        series[report.label_of(rows, Path(path).stem)] = agg
    if not args.no_plot:
        prefix = args.plot_prefix or str(Path(args.report[0]).with_suffix(""))
        _plots(series, prefix, "")
    return 0


def _run_bench(args) -> int:
    from glm_ray.bench import client  # noqa: PLC0415 - deferred: aiohttp (the `bench` extra)

    extra: dict = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
            assert isinstance(extra, dict)
        except (json.JSONDecodeError, AssertionError):
            _err("--extra-body must be a JSON object")
            return 2
    if not 0.0 <= args.range_ratio <= 1.0:
        _err("--range-ratio must be in [0, 1]")
        return 2
    cfg = client.BenchConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint,
        input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
        concurrencies=tuple(args.concurrency), prompts_per_concurrency=args.prompts_per_concurrency,
        num_prompts=args.num_prompts, request_rate=args.request_rate,
        warmup_requests=args.warmup_requests, warmup_output_len=args.warmup_output_len,
        warmup_pause_s=args.warmup_pause, repetitions=args.repetitions, seed=args.seed,
        vocab_size=args.vocab_size, exclude_token_ids=tuple(args.exclude_token_ids), label=args.label,
        request_timeout_s=args.request_timeout, usage_per_chunk=args.usage_per_chunk, extra_body=extra,
        tolerance=args.tolerance, show_progress=not args.no_progress,
    )
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    result_file = Path(args.result_file) if args.result_file else Path(
        "bench-results") / f"{stamp}_{_slug(args.label or 'bench')}_{args.input_len}x{args.output_len}.jsonl"
    stem = str(result_file.with_suffix(""))
    requests_file = Path(stem + "_requests.jsonl") if args.save_requests else None
    rows: list[dict] = []

    def on_start(server: client.ServerInfo) -> None:
        usage = "per chunk (exact)" if server.usage_per_chunk else "final only (1 token per text chunk)"
        _print(f"bench: {cfg.base_url} model={server.model} input={cfg.input_len} output={cfg.output_len} "
               f"range_ratio={cfg.range_ratio} rate={cfg.request_rate} C={list(cfg.concurrencies)} "
               f"reps={cfg.repetitions} vocab={server.vocab_size} ({server.vocab_source}) usage={usage}")
        _print(f"results -> {result_file}")

    def on_result(res: client.RunResult, server: client.ServerInfo) -> None:
        config = {
            "label": cfg.label, "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "base_url": cfg.base_url, "endpoint": cfg.endpoint, "model": server.model,
            "input_len": cfg.input_len, "output_len": cfg.output_len, "range_ratio": cfg.range_ratio,
            "max_concurrency": res.concurrency, "num_prompts": res.num_prompts,
            "request_rate": cfg.request_rate, "repetition": res.repetition, "repetitions": cfg.repetitions,
            "seed": cfg.seed, "vocab_size": server.vocab_size, "warmup_requests": cfg.warmup_requests,
            "usage_per_chunk": server.usage_per_chunk, "itl_semantics": metrics.ITL_SEMANTICS,
            "tolerance": cfg.tolerance,
        }
        row = report.result_row(config, res.summary.to_dict())
        report.append_jsonl(result_file, row)
        rows.append(row)
        if requests_file is not None:
            for rec in res.records:
                report.append_jsonl(requests_file, {"label": cfg.label, "max_concurrency": res.concurrency,
                                                    "repetition": res.repetition, **rec.to_dict(res.t0)})
        _print(report.format_run_detail(row) if args.detail else report.format_run_line(row))
        if not args.detail:
            for c in row["consistency"]:
                if c["ok"] is False:
                    _print(f"  WARNING consistency {c['name']}: observed {c['observed']:.4g} vs expected "
                           f"{c['expected']:.4g} ({c['rel_err'] * 100:.1f}% > {c['tolerance'] * 100:.0f}%)")
            for err, n in row["errors"].items():
                _print(f"  failed x{n}: {err}")
        if row["completed"] and not row["output_len_matches_request"]:
            _print(f"  WARNING: output lengths differ from max_tokens (mean {row['mean_output_len']:.1f}); "
                   "does the server honour ignore_eos?")
        if (row.get("mean_first_chunk_tokens") or 1.0) > 1.0:
            _print(f"  note: first chunks carried {row['mean_first_chunk_tokens']:.2f} tokens on average "
                   "(TTFT is to the first chunk; those tokens have no ITL entry)")
        if row["completed"] and not row["token_counts_exact"]:
            _print("  note: tokens per chunk were estimated (server sent no per-chunk usage)")

    try:
        client.run_sweep(cfg, on_start, on_result)
    except client.BenchError as e:
        _err(str(e))
        return 2
    except KeyboardInterrupt:
        _err(f"interrupted; {len(rows)} finished run(s) are in {result_file}")
        return 130
    if not rows:
        return 2
    agg = report.aggregate(rows, args.aggregate, args.drop_outlier)
    _print("")
    _print(f"{report.describe_rows(rows)}")
    _print(report.format_table(agg, args.format))
    _print(report.table_footer(agg, args.aggregate))
    if not args.no_plot:
        _plots({report.label_of(rows, "run"): agg}, args.plot_prefix or stem,
               f"{rows[0]['model']} {cfg.input_len}/{cfg.output_len}")
    if any(r["failed"] for r in rows):
        return 1
    if args.strict and not all(r["consistent"] for r in rows):
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    """Entry point for `glm-ray bench` (benchmark, --compare or --report)."""
    if args.compare:
        return _run_compare(args)
    if args.report:
        return _run_report(args)
    return _run_bench(args)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
