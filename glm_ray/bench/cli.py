"""`glm-ray bench`: command-line front end of the serving benchmark.

Owns the flags and the three modes; the work is done by `client` (load + timings), `datasets`
(the requests), `metrics` (definitions) and `report` (tables, JSONL, plots).

  run      glm-ray bench --base-url http://127.0.0.1:8000 --dataset-name random --random-input-len 1024 \\
               --random-output-len 1024 --num-prompts 64 --max-concurrency 16    (sglang / vLLM form)
           glm-ray bench --input-len 1024 --output-len 1024 --random-range-ratio 1 \\
               --concurrency 4 8 16 32 64 --repetitions 3 --label fp8_proj=off   (a sweep, origin PR B)
  compare  glm-ray bench --compare off.jsonl on.jsonl       (PR B delta table, B vs A)
  report   glm-ray bench --report off.jsonl [more.jsonl...] (table + plots from saved results)

Flags are sglang.bench_serving's names with its meanings and defaults (most are vLLM's too):
``--backend``, ``--base-url``/``--host``/``--port``, ``--model``, ``--served-model-name``, ``--tokenizer``,
``--dataset-name random|random-ids|sharegpt|generated-shared-prefix``, ``--dataset-path``,
``--num-prompts``, ``--random-input-len``, ``--random-output-len``, ``--random-range-ratio``,
``--sharegpt-output-len``, ``--sharegpt-context-len``, ``--gsp-*``, ``--request-rate``,
``--max-concurrency``, ``--seed``, ``--disable-ignore-eos``, ``--disable-stream``, ``--output-file``,
``--output-details``, ``--extra-request-body``, ``--warmup-requests``, ``--disable-tqdm``, ``--tag``;
from vLLM ``--endpoint``, ``--ignore-eos``, ``--random-prefix-len``. Our older names are aliases of the
same settings: ``--input-len``, ``--output-len``, ``--range-ratio``, ``--concurrency``, ``--result-file``,
``--extra-body``, ``--no-progress``, ``--label``. Ours only: several ``--max-concurrency`` values (a
sweep), ``--prompts-per-concurrency``, ``--repetitions``, the consistency checks, ``--compare``/``--report``.

Where sglang and vLLM differ, we follow sglang:
- ``--random-range-ratio`` r: sglang draws lengths uniform in [max(int(L*r), 1), L], default 0.0 =
  uniform in [1, L]; vLLM draws from [floor(L*(1-r)), ceil(L*(1+r))], r < 1, default 0.0 = fixed L.
  For fixed lengths here pass ``--random-range-ratio 1``.
- ``--random-output-len`` default: sglang 1024, vLLM 128. ``--seed``: sglang 1, vLLM 0.
- EOS: sglang ignores it unless ``--disable-ignore-eos``; vLLM honours it unless ``--ignore-eos``.
- ``--dataset-name`` default: sglang sharegpt (downloaded), vLLM random; here random (nothing is ever
  downloaded; ShareGPT is read from ``--dataset-path``). ShareGPT filter: sglang's (see `datasets`).
- Defaults of the address: ``--host`` 127.0.0.1 (vLLM; sglang 0.0.0.0), ``--port`` 8000 (our server's
  and vLLM's; sglang's depends on ``--backend``, 30000 for its own).
- The printed block is sglang's (vLLM prints other rows); ITL is sglang's per-token ITL.
``--backend``: every value speaks the OpenAI API of this server: ``*-chat`` backends
``/v1/chat/completions``, the others ``/v1/completions`` with token-id prompts (sglang's ``sglang`` /
``sglang-native`` mean its own ``/generate``; the load is the same). ``--max-concurrency`` unset means
no limit (sglang's "not set"); ``--num-prompts`` defaults to 1000, except in a sweep (several
``--max-concurrency`` values), where each point sends ``--prompts-per-concurrency`` (4) x C.

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

DEFAULT_CONCURRENCIES = (4, 8, 16, 32, 64)       # the README's sweep (origin PR B); not a default any more
SGLANG_NUM_PROMPTS = 1000                        # sglang's and vLLM's --num-prompts default
SWEEP_PROMPTS_PER_CONCURRENCY = 4                # a sweep's default: N = 4 x C (origin PR B)
COMPLETION_BACKENDS = ("sglang", "sglang-native", "sglang-oai", "vllm", "openai", "lmdeploy")
CHAT_BACKENDS = ("sglang-oai-chat", "vllm-chat", "openai-chat", "lmdeploy-chat")
DATASET_NAMES = ("random", "random-ids", "sharegpt", "generated-shared-prefix")


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
    g = p.add_argument_group("server (sglang.bench_serving / vllm bench serve names)")
    g.add_argument("--backend", choices=COMPLETION_BACKENDS + CHAT_BACKENDS, default="sglang-oai",
                   help="*-chat: /v1/chat/completions; the others: /v1/completions with token-id prompts "
                        "(default %(default)s)")
    g.add_argument("--base-url", default=None,
                   help="OpenAI-compatible server (ours, vLLM, SGLang); default http://HOST:PORT")
    g.add_argument("--host", default="127.0.0.1", help="with --port, when --base-url is not given (default %(default)s)")
    g.add_argument("--port", type=int, default=8000, help="default %(default)s (our server's and vLLM's)")
    g.add_argument("--model", default=None, help="model name to send (default: first id of GET /v1/models)")
    g.add_argument("--served-model-name", default=None, help="name to send instead of --model (sglang)")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="local tokenizer directory for ShareGPT text and chat prompts (default: the server's "
                        "/tokenize and /detokenize; nothing is downloaded)")
    g.add_argument("--endpoint", default=None,
                   help="request path (default: /v1/completions, or /v1/chat/completions for *-chat backends)")
    g.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="fail a request after S seconds without data (default %(default)s)")
    g.add_argument("--usage-per-chunk", choices=("auto", "on", "off"), default="auto",
                   help="ask for stream_options.continuous_usage_stats to count tokens per chunk exactly; "
                        "auto falls back when the server refuses it (default %(default)s)")
    g.add_argument("--extra-request-body", "--extra-body", dest="extra_body", default=None, metavar="JSON",
                   help="JSON object merged into every request body")
    g.add_argument("--disable-ignore-eos", dest="disable_ignore_eos", action="store_true", default=False,
                   help="send ignore_eos: false (sglang; default: ignore EOS, outputs are exactly max_tokens)")
    g.add_argument("--ignore-eos", dest="disable_ignore_eos", action="store_false",
                   help="vLLM's flag: ignore EOS (already the default here)")
    g.add_argument("--disable-stream", action="store_true",
                   help="non-streaming requests: TTFT = E2E latency, no ITL (sglang)")

    g = p.add_argument_group("workload")
    g.add_argument("--dataset-name", choices=DATASET_NAMES, default="random",
                   help="random (= sglang's random-ids: random token ids), sharegpt (--dataset-path), "
                        "generated-shared-prefix (--gsp-*) (default %(default)s; sglang's is sharegpt)")
    g.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file (read, never downloaded)")
    g.add_argument("--num-prompts", type=_positive_int, default=None,
                   help=f"prompts per run (default {SGLANG_NUM_PROMPTS}; in a sweep "
                        f"{SWEEP_PROMPTS_PER_CONCURRENCY} x C; generated-shared-prefix: groups x prompts per group)")
    g.add_argument("--random-input-len", "--input-len", dest="random_input_len", type=_positive_int, default=1024,
                   help="random dataset: prompt tokens (default %(default)s)")
    g.add_argument("--random-output-len", "--output-len", dest="random_output_len", type=_positive_int,
                   default=1024, help="random dataset: output tokens (default %(default)s; vLLM's is 128)")
    g.add_argument("--random-range-ratio", "--range-ratio", dest="random_range_ratio", type=float, default=0.0,
                   help="sglang's law: lengths uniform in [max(int(L*r), 1), L]; 0 (default, sglang's) = [1, L], "
                        "1 = fixed lengths (vLLM's flag of this name means [L(1-r), L(1+r)])")
    g.add_argument("--random-prefix-len", type=int, default=0,
                   help="vLLM: random ids shared by every random prompt, before its own (default %(default)s)")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: fixed output length (>= 4) instead of the reply's token count")
    g.add_argument("--sharegpt-context-len", type=int, default=None,
                   help="sharegpt: skip pairs whose prompt + output exceed this")
    g.add_argument("--gsp-num-groups", type=_positive_int, default=64, help="shared prefixes (default %(default)s)")
    g.add_argument("--gsp-prompts-per-group", type=_positive_int, default=16,
                   help="prompts per shared prefix (default %(default)s)")
    g.add_argument("--gsp-system-prompt-len", type=_positive_int, default=2048,
                   help="shared prefix tokens (default %(default)s)")
    g.add_argument("--gsp-question-len", type=_positive_int, default=128,
                   help="tokens after the prefix (default %(default)s)")
    g.add_argument("--gsp-output-len", type=_positive_int, default=256, help="output tokens (default %(default)s)")
    g.add_argument("--gsp-range-ratio", type=float, default=1.0,
                   help="the same law for the --gsp-* lengths (default %(default)s: fixed, as sglang)")
    g.add_argument("--max-concurrency", "--concurrency", dest="max_concurrency", type=_positive_int, nargs="+",
                   default=None, metavar="C",
                   help="requests in flight at most (default: no limit, sglang's 'not set'); several values run "
                        "a sweep, e.g. 4 8 16 32 64")
    g.add_argument("--prompts-per-concurrency", type=_positive_int, default=None, metavar="K",
                   help=f"num-prompts = K x C at each point (default in a sweep: {SWEEP_PROMPTS_PER_CONCURRENCY})")
    g.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="requests/s, Poisson arrivals; inf sends all at once under the semaphore (default inf)")
    g.add_argument("--warmup-requests", type=int, default=1, help="warm-up requests before each run (default %(default)s)")
    g.add_argument("--warmup-output-len", type=_positive_int, default=32, help="output tokens of warm-up requests")
    g.add_argument("--warmup-pause", type=float, default=1.0, metavar="S", help="pause after warm-up (default %(default)s)")
    g.add_argument("--repetitions", type=_positive_int, default=1, help="runs per concurrency (origin PR B: 3)")
    g.add_argument("--seed", type=int, default=1, help="default %(default)s (sglang's; vLLM's is 0)")
    g.add_argument("--vocab-size", type=_positive_int, default=None,
                   help="token ids are drawn from [0, V) (default: the server's vocab_size if /v1/models "
                        "advertises one, else 1024; use 154880 for GLM-5 / GLM-4.7-Flash)")
    g.add_argument("--exclude-token-ids", type=_int_list, default=[], metavar="IDS",
                   help="comma-separated ids never to put in prompts (special tokens)")

    g = p.add_argument_group("output")
    g.add_argument("--tag", "--label", dest="label", default="", help='tag stored with every result, e.g. "fp8_proj=off"')
    g.add_argument("--output-file", "--result-file", dest="output_file", default=None, metavar="PATH",
                   help="JSONL to append one line per run to: our keys and sglang's (default "
                        "bench-results/<time>_<tag>_<workload>.jsonl)")
    g.add_argument("--output-details", action="store_true",
                   help="also put per-request input_lens, output_lens, ttfts, itls (sglang's) and request_errors "
                        "(sglang: errors) in each line")
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
    g.add_argument("--detail", action="store_true",
                   help="print the sglang result block after every run of a sweep (a single run always does)")
    g.add_argument("--disable-tqdm", "--no-progress", dest="no_progress", action="store_true", help="no progress bar")

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


def _workload(args, concs: list[int | None]) -> tuple[int | None, int | None, list[str]]:
    """(num_prompts, prompts_per_concurrency, notes) from the flags (see the module doc), or raise ValueError."""
    notes = []
    if args.dataset_name == "generated-shared-prefix":
        if args.num_prompts is not None:
            notes.append(f"--num-prompts {args.num_prompts} is not used by generated-shared-prefix (as in "
                         f"sglang): {args.gsp_num_groups} groups x {args.gsp_prompts_per_group} prompts")
        return None, None, notes
    if args.num_prompts is not None:
        return args.num_prompts, None, notes
    if args.prompts_per_concurrency is not None:
        if None in concs:
            raise ValueError("--prompts-per-concurrency needs --max-concurrency")
        return None, args.prompts_per_concurrency, notes
    if len(concs) > 1:
        return None, SWEEP_PROMPTS_PER_CONCURRENCY, notes
    return SGLANG_NUM_PROMPTS, None, notes


def _describe_workload(args) -> str:
    """The workload part of the default result file name and of the start line."""
    if args.dataset_name == "sharegpt":
        return "sharegpt" + (f"-out{args.sharegpt_output_len}" if args.sharegpt_output_len else "")
    if args.dataset_name == "generated-shared-prefix":
        return (f"gsp{args.gsp_num_groups}x{args.gsp_prompts_per_group}_{args.gsp_system_prompt_len}+"
                f"{args.gsp_question_len}x{args.gsp_output_len}")
    return f"{args.random_input_len}x{args.random_output_len}"


def _run_config(args, cfg, server, res) -> dict[str, Any]:
    """The config half of a result line: ours, then sglang's names for its arguments."""
    random = cfg.dataset == "random"
    c = {
        "label": cfg.label, "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "base_url": cfg.base_url, "endpoint": cfg.endpoint, "model": server.model,
        "input_len": cfg.input_len if random else None, "output_len": cfg.output_len if random else None,
        "range_ratio": cfg.range_ratio if random else None,
        "max_concurrency": res.concurrency, "num_prompts": res.num_prompts,
        "request_rate": cfg.request_rate, "repetition": res.repetition, "repetitions": cfg.repetitions,
        "seed": cfg.seed, "vocab_size": server.vocab_size, "warmup_requests": cfg.warmup_requests,
        "usage_per_chunk": server.usage_per_chunk, "itl_semantics": metrics.ITL_SEMANTICS,
        "tolerance": cfg.tolerance, "ignore_eos": cfg.ignore_eos, "stream": cfg.stream,
        # sglang's --output-file argument keys
        "tag": cfg.label or None, "backend": cfg.backend, "dataset_name": args.dataset_name,
        "sharegpt_output_len": cfg.sharegpt_output_len, "random_input_len": cfg.input_len,
        "random_output_len": cfg.output_len, "random_range_ratio": cfg.range_ratio,
    }
    if cfg.dataset == "sharegpt":
        c.update(dataset_path=cfg.dataset_path, sharegpt_context_len=cfg.sharegpt_context_len)
    if cfg.dataset == "generated-shared-prefix":
        c.update({f"gsp_{k}": getattr(cfg, f"gsp_{k}") for k in
                  ("num_groups", "prompts_per_group", "system_prompt_len", "question_len", "output_len", "range_ratio")})
    if cfg.random_prefix_len:
        c["random_prefix_len"] = cfg.random_prefix_len
    return c


def _details(res) -> dict[str, list]:
    """sglang's --output-details lists (seconds, per request in send order). sglang's per-request
    ``errors`` list is ``request_errors`` here: ``errors`` is our error -> count summary."""
    recs = res.records
    return {"input_lens": [r.prompt_len for r in recs],
            "output_lens": [metrics.output_len(r) if r.success else 0 for r in recs],
            "ttfts": [metrics.ttft(r) or 0.0 for r in recs],
            "itls": [metrics.itl_per_token(r) for r in recs],
            "request_errors": [r.error for r in recs]}


def build_config(args):
    """The `client.BenchConfig` the flags mean, and notes to print; ValueError for a usage error."""
    from glm_ray.bench import client  # noqa: PLC0415 - deferred: aiohttp (the `bench` extra)

    extra: dict = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except json.JSONDecodeError:
            extra = None
        if not isinstance(extra, dict):
            raise ValueError("--extra-request-body (--extra-body) must be a JSON object")
    for flag, v in (("--random-range-ratio (--range-ratio)", args.random_range_ratio),
                    ("--gsp-range-ratio", args.gsp_range_ratio)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{flag} must be in [0, 1] (sglang's law: lengths uniform in [max(int(L*r), 1), L])")
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path (a ShareGPT JSON file; nothing is downloaded)")
    if args.sharegpt_output_len is not None and args.sharegpt_output_len < 4:
        raise ValueError("--sharegpt-output-len must be >= 4 (sglang's rule)")
    concs: list[int | None] = list(args.max_concurrency) if args.max_concurrency else [None]
    num_prompts, ppc, notes = _workload(args, concs)
    chat = args.backend in CHAT_BACKENDS
    cfg = client.BenchConfig(
        base_url=(args.base_url or f"http://{args.host}:{args.port}").rstrip("/"),
        model=args.served_model_name or args.model,
        endpoint=args.endpoint or ("/v1/chat/completions" if chat else "/v1/completions"),
        api="chat" if chat else "completions", backend=args.backend, stream=not args.disable_stream,
        ignore_eos=not args.disable_ignore_eos,
        dataset={"random-ids": "random"}.get(args.dataset_name, args.dataset_name),
        dataset_path=args.dataset_path, tokenizer=args.tokenizer,
        sharegpt_output_len=args.sharegpt_output_len, sharegpt_context_len=args.sharegpt_context_len,
        gsp_num_groups=args.gsp_num_groups, gsp_prompts_per_group=args.gsp_prompts_per_group,
        gsp_system_prompt_len=args.gsp_system_prompt_len, gsp_question_len=args.gsp_question_len,
        gsp_output_len=args.gsp_output_len, gsp_range_ratio=args.gsp_range_ratio,
        input_len=args.random_input_len, output_len=args.random_output_len, range_ratio=args.random_range_ratio,
        random_prefix_len=args.random_prefix_len,
        concurrencies=tuple(concs), prompts_per_concurrency=ppc or SWEEP_PROMPTS_PER_CONCURRENCY,
        num_prompts=num_prompts, request_rate=args.request_rate,
        warmup_requests=args.warmup_requests, warmup_output_len=args.warmup_output_len,
        warmup_pause_s=args.warmup_pause, repetitions=args.repetitions, seed=args.seed,
        vocab_size=args.vocab_size, exclude_token_ids=tuple(args.exclude_token_ids), label=args.label,
        request_timeout_s=args.request_timeout, usage_per_chunk=args.usage_per_chunk, extra_body=extra,
        tolerance=args.tolerance, show_progress=not args.no_progress,
    )
    return cfg, notes


def _run_bench(args) -> int:
    from glm_ray.bench import client  # noqa: PLC0415 - deferred: aiohttp (the `bench` extra)

    try:
        cfg, notes = build_config(args)
    except ValueError as e:
        _err(str(e))
        return 2
    concs = list(cfg.concurrencies)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    result_file = Path(args.output_file) if args.output_file else Path(
        "bench-results") / f"{stamp}_{_slug(args.label or 'bench')}_{_describe_workload(args)}.jsonl"
    stem = str(result_file.with_suffix(""))
    requests_file = Path(stem + "_requests.jsonl") if args.save_requests else None
    single = len(concs) == 1 and args.repetitions == 1
    rows: list[dict] = []

    def on_start(server: client.ServerInfo) -> None:
        usage = ("per chunk (exact)" if server.usage_per_chunk else "final only (1 token per text chunk)") \
            if cfg.stream else "none (not streamed)"
        n = (f"N={cfg.gsp_num_groups * cfg.gsp_prompts_per_group}" if cfg.dataset == "generated-shared-prefix"
             else f"N={cfg.num_prompts}" if cfg.num_prompts else f"N={cfg.prompts_per_concurrency}xC")
        ratio = f" range_ratio={cfg.range_ratio}" if cfg.dataset == "random" else ""
        _print(f"bench: {cfg.base_url}{cfg.endpoint} backend={cfg.backend} model={server.model} "
               f"dataset={args.dataset_name} {_describe_workload(args)}{ratio} {n} rate={cfg.request_rate} "
               f"C={[report.conc_str(c) for c in cfg.concurrencies]} reps={cfg.repetitions} "
               f"vocab={server.vocab_size} ({server.vocab_source}) usage={usage} "
               f"ignore_eos={cfg.ignore_eos} seed={cfg.seed}")
        if server.dataset_rows is not None:
            _print(f"sharegpt: {server.dataset_rows} usable conversation(s) from {cfg.dataset_path}")
        for note in notes:
            _print(f"note: {note}")
        _print(f"results -> {result_file}")

    def on_result(res: client.RunResult, server: client.ServerInfo) -> None:
        row = report.result_row(_run_config(args, cfg, server, res), res.summary.to_dict())
        if args.output_details:
            row.update(_details(res))
        report.append_jsonl(result_file, row)
        rows.append(row)
        if requests_file is not None:
            for rec in res.records:
                report.append_jsonl(requests_file, {"label": cfg.label, "max_concurrency": res.concurrency,
                                                    "repetition": res.repetition, **rec.to_dict(res.t0)})
        detail = single or args.detail
        _print(("\n" + report.format_run_detail(row)) if detail else report.format_run_line(row))
        if not detail:
            for c in row["consistency"]:
                if c["ok"] is False:
                    _print(f"  WARNING consistency {c['name']}: observed {c['observed']:.4g} vs expected "
                           f"{c['expected']:.4g} ({c['rel_err'] * 100:.1f}% > {c['tolerance'] * 100:.0f}%)")
            for err, n in row["errors"].items():
                _print(f"  failed x{n}: {err}")
        if row["completed"] and not row["output_len_matches_request"] and cfg.ignore_eos:
            _print(f"  WARNING: output lengths differ from max_tokens (mean {row['mean_output_len']:.1f}); "
                   "does the server honour ignore_eos?")
        if cfg.stream and (row.get("mean_first_chunk_tokens") or 1.0) > 1.0:
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
               f"{rows[0]['model']} {args.dataset_name} {_describe_workload(args)}")
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
