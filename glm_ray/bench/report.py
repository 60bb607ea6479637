"""Serving-benchmark reports: JSONL results, tables, the A-vs-B delta table, and PNG plots.

This module owns everything a person reads or a later run loads back:

- `result_row` / `append_jsonl` / `load_jsonl`: one JSON object per (concurrency, repetition) run,
  holding the run's config and every `metrics.RunSummary` field (sglang-style keys such as
  ``mean_ttft_ms``, ``p99_e2el_ms``, ``output_throughput``), plus the keys sglang's ``--output-file``
  lines use for the same numbers (``duration``, ``mean_e2e_latency_ms``, ``concurrency``,
  ``max_output_tokens_per_s``, ...), so tools reading sglang's JSONL read ours.
- `aggregate`: mean (or median) over repetitions per concurrency, optionally dropping the single
  run furthest from the median output throughput (origin PR B dropped one outlier per point).
- `format_table` / `format_compare`: the table shape of origin PR B (concurrency, TTFT, ITL, E2EL,
  output tok/s; the compare table adds a delta column after each), as aligned text, markdown or TSV.
- `format_sglang_block`: sglang.bench_serving's "Serving Benchmark Result" block, row for row (labels,
  order, ``{:<40} {:<10}`` layout), so an sglang log and ours diff line by line; `format_run_detail`:
  that block followed by our extra rows (failures, more percentiles, per-chunk ITL, consistency
  checks); `format_run_line`: one line per run.
- `plot_latency` / `plot_throughput`: PNGs with matplotlib (Agg backend), one series per label.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

SCHEMA = "glm-ray-bench/1"

# (key in a result row, column title, decimals) of the PR B table
TABLE_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("mean_ttft_ms", "TTFT (ms)", 1),
    ("mean_itl_ms", "ITL (ms)", 2),
    ("mean_e2el_ms", "E2EL (ms)", 0),
    ("output_throughput", "output tok/s", 1),
)
# metrics averaged over repetitions (everything numeric is averaged; these are the ones shown)
MINUS = "\u2212"


# ----------------------------------------------------------------------------------------------
# JSONL

def _json_float(x: float) -> Any:
    return "inf" if isinstance(x, float) and math.isinf(x) else x


def _finite(x: Any) -> Any:
    """Strict-JSON copy: non-finite floats become None, recursively."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


# sglang's --output-file key -> our key holding the same number (sglang.bench_serving's result dict)
SGLANG_KEYS: dict[str, str] = {
    "duration": "duration_s",
    "total_input_text_tokens": "total_input_tokens",
    "mean_e2e_latency_ms": "mean_e2el_ms",
    "median_e2e_latency_ms": "median_e2el_ms",
    "std_e2e_latency_ms": "std_e2el_ms",
    "p90_e2e_latency_ms": "p90_e2el_ms",
    "p99_e2e_latency_ms": "p99_e2el_ms",
    "concurrency": "achieved_concurrency",
    "max_output_tokens_per_s": "peak_output_throughput",
    "max_concurrent_requests": "peak_concurrent_requests",
}


def result_row(config: dict[str, Any], summary_dict: dict[str, Any]) -> dict[str, Any]:
    """One JSONL line: schema tag, the run's config, the flat summary metrics, then sglang's names
    (`SGLANG_KEYS`) for the numbers it also reports.

    An infinite request rate is written as the string "inf"; other non-finite numbers as null.
    """
    row: dict[str, Any] = {"schema": SCHEMA}
    row.update({k: _json_float(v) for k, v in config.items()})
    row.update(_finite(summary_dict))
    for theirs, ours in SGLANG_KEYS.items():
        if ours in row and theirs not in row:
            row[theirs] = row[ours]
    return row


def append_jsonl(path: str | Path, row: dict[str, Any]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("a", encoding="utf-8") as f:
        f.write(json.dumps(row, allow_nan=False, default=str) + "\n")


def load_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a results file (blank lines skipped). Raises ValueError naming the bad line."""
    rows = []
    with Path(path).open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not JSON ({e.msg})") from None
    if not rows:
        raise ValueError(f"{path}: no results")
    return rows


# ----------------------------------------------------------------------------------------------
# Aggregation over repetitions

@dataclass
class AggRow:
    """Metrics of one concurrency level, combined over its repetitions."""

    concurrency: int | None           # None: no limit (sglang's "not set")
    input_len: int | None
    output_len: int | None
    reps: int                         # runs used
    dropped: int                      # runs dropped as outliers
    values: dict[str, float | None] = field(default_factory=dict)
    failed: int = 0                   # failed requests over all runs used
    consistent: bool = True           # every run used passed its consistency checks


def aggregate(rows: Iterable[dict[str, Any]], how: str = "mean", drop_outlier: bool = False) -> list[AggRow]:
    """Group runs by (concurrency, input_len, output_len) and combine numeric metrics.

    ``how``: "mean" (origin PR B: mean of 3 reps) or "median". ``drop_outlier``: with at least 3
    runs, leave out the single one whose output throughput is furthest from the group median.
    """
    if how not in ("mean", "median"):
        raise ValueError(f"unknown aggregation {how!r}")
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        c = r.get("max_concurrency")
        key = (None if c is None else int(c), r.get("input_len"), r.get("output_len"))
        groups.setdefault(key, []).append(r)
    out = []
    for (c, il, ol), runs in sorted(groups.items(), key=lambda kv: (kv[0][0] is None, kv[0][0] or 0,
                                                                    str(kv[0][1:]))):
        dropped = 0
        if drop_outlier and len(runs) >= 3:
            med = statistics.median(r.get("output_throughput") or 0.0 for r in runs)
            worst = max(range(len(runs)), key=lambda i: abs((runs[i].get("output_throughput") or 0.0) - med))
            runs = runs[:worst] + runs[worst + 1:]
            dropped = 1
        keys = sorted({k for r in runs for k, v in r.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)})
        vals: dict[str, float | None] = {}
        for k in keys:
            xs = [r[k] for r in runs if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)]
            vals[k] = (statistics.fmean(xs) if how == "mean" else statistics.median(xs)) if xs else None
        out.append(AggRow(
            concurrency=c, input_len=il, output_len=ol, reps=len(runs), dropped=dropped, values=vals,
            failed=sum(int(r.get("failed") or 0) for r in runs),
            consistent=all(r.get("consistent", True) is not False for r in runs),
        ))
    return out


# ----------------------------------------------------------------------------------------------
# Tables

def conc_str(c: int | None) -> str:
    """A max-concurrency value as sglang prints it."""
    return "not set" if c is None else str(c)


def _fmt(x: float | None, decimals: int) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{decimals}f}"


def _fmt_delta(a: float | None, b: float | None) -> str:
    if a is None or b is None or a == 0:
        return "-"
    return f"{(b - a) / a * 100.0:+.1f}%".replace("-", MINUS)


def render(header: Sequence[str], body: Sequence[Sequence[str]], fmt: str = "text") -> str:
    """Render rows as aligned ``text`` (numbers right-aligned), ``markdown`` or ``tsv``."""
    if fmt == "tsv":
        return "\n".join("\t".join(r) for r in [list(header), *body])
    if fmt == "markdown":
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in body]
        return "\n".join(lines)
    if fmt != "text":
        raise ValueError(f"unknown table format {fmt!r}")
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


def format_table(agg: Sequence[AggRow], fmt: str = "text") -> str:
    """PR B table: concurrency, TTFT (ms), ITL (ms), E2EL (ms), output tok/s (means)."""
    header = ["concurrency"] + [t for _, t, _ in TABLE_COLUMNS]
    body = [[conc_str(a.concurrency)] + [_fmt(a.values.get(k), d) for k, _, d in TABLE_COLUMNS] for a in agg]
    return render(header, body, fmt)


def format_compare(base: Sequence[AggRow], feat: Sequence[AggRow], fmt: str = "text") -> str:
    """PR B "feature on" table: B's values with the relative change vs A after each column.

    Rows are matched on (concurrency, input_len, output_len); unmatched rows show "-" deltas.
    """
    by_key = {(a.concurrency, a.input_len, a.output_len): a for a in base}
    header = ["concurrency"]
    for _, t, _ in TABLE_COLUMNS:
        header += [t, "\u0394"]
    body = []
    for b in feat:
        a = by_key.get((b.concurrency, b.input_len, b.output_len))
        row = [conc_str(b.concurrency)]
        for k, _, d in TABLE_COLUMNS:
            row += [_fmt(b.values.get(k), d), _fmt_delta(a.values.get(k) if a else None, b.values.get(k))]
        body.append(row)
    return render(header, body, fmt)


def describe_rows(rows: Sequence[dict[str, Any]]) -> str:
    """One line naming what a results file measured (label, model, lengths, reps)."""
    r0 = rows[0]
    labels = sorted({str(r.get("label") or "") for r in rows} - {""})
    reps = max(int(r.get("repetition", 0)) for r in rows) + 1
    dataset = r0.get("dataset_name") or "random"
    workload = (f"input={r0.get('input_len')} output={r0.get('output_len')} range_ratio={r0.get('range_ratio')}"
                if dataset in ("random", "random-ids") else f"dataset={dataset}")
    return (f"{', '.join(labels) or 'unlabelled'}: model={r0.get('model')} {workload} "
            f"rate={r0.get('request_rate')} reps={reps}")


def table_footer(agg: Sequence[AggRow], how: str = "mean") -> str:
    """Notes under a table: aggregation, ITL semantics, failures and consistency."""
    reps = sorted({a.reps for a in agg})
    dropped = sum(a.dropped for a in agg)
    notes = [f"{how} of {'/'.join(map(str, reps))} rep(s) per point"
             + (f", {dropped} outlier run(s) dropped" if dropped else ""),
             "ITL = sglang-native per-token ITL; TTFT/ITL/E2EL are means"]
    failed = sum(a.failed for a in agg)
    if failed:
        notes.append(f"WARNING: {failed} failed request(s)")
    bad = [conc_str(a.concurrency) for a in agg if not a.consistent]
    notes.append("consistency checks: " + (f"FAILED at C={','.join(bad)}" if bad else "all pass"))
    return "; ".join(notes)


def label_of(rows: Sequence[dict[str, Any]], fallback: str) -> str:
    labels = sorted({str(r.get("label") or "") for r in rows} - {""})
    return ", ".join(labels) if labels else fallback


def format_compare_report(rows_a: Sequence[dict], rows_b: Sequence[dict], *, name_a: str = "A",
                          name_b: str = "B", fmt: str = "text", how: str = "mean",
                          drop_outlier: bool = False) -> str:
    """Both PR B tables: A (baseline) on its own, then B with deltas vs A, plus config warnings."""
    agg_a = aggregate(rows_a, how, drop_outlier)
    agg_b = aggregate(rows_b, how, drop_outlier)
    la, lb = label_of(rows_a, name_a), label_of(rows_b, name_b)
    parts = []
    for key in ("model", "input_len", "output_len", "range_ratio", "request_rate", "itl_semantics"):
        va = {str(r.get(key)) for r in rows_a}
        vb = {str(r.get(key)) for r in rows_b}
        if va != vb:
            parts.append(f"WARNING: {key} differs: A={','.join(sorted(va))} B={','.join(sorted(vb))}")
    parts += [f"A. Baseline ({la}):", format_table(agg_a, fmt), table_footer(agg_a, how), "",
              f"B. {lb} (\u0394 vs baseline):", format_compare(agg_a, agg_b, fmt), table_footer(agg_b, how)]
    return "\n".join(parts)


def format_run_line(row: dict[str, Any]) -> str:
    """One line per finished run (printed while the sweep goes on)."""
    cons = "ok" if row.get("consistent", True) else "INCONSISTENT"
    done, failed = int(row.get("completed") or 0), int(row.get("failed") or 0)
    return (f"C={conc_str(row.get('max_concurrency')):<3} rep {int(row.get('repetition') or 0) + 1}: "
            f"{done}/{done + failed} ok  "
            f"TTFT {_fmt(row.get('mean_ttft_ms'), 1)} ms  ITL {_fmt(row.get('mean_itl_ms'), 2)} ms  "
            f"E2EL {_fmt(row.get('mean_e2el_ms'), 0)} ms  out {_fmt(row.get('output_throughput'), 1)} tok/s  "
            f"[{cons}]")


# sglang.bench_serving's "Serving Benchmark Result" block, in its order: (label, our row key, format),
# ("-", title) for a section rule. Read from sglang's bench_serving.py (2025-26); its rows that we print
# differently or not at all:
#   - "Total input vision tokens:" is printed by sglang for its image/mmmu datasets only: none here.
#   - "Total generated tokens (retokenized):" is sglang re-encoding the generated text with its local
#     tokenizer; we keep no text, so the row carries the server's count (the "Total generated tokens" value).
#   - "Accept length:" is printed only when an sglang server reports speculative-decoding acceptance.
#   - "Traffic request rate:" prints "trace" for sglang's mooncake replay, which we do not have.
SGLANG_BLOCK: tuple[tuple[str, str, str], ...] = (
    ("Backend:", "backend", "s"),
    ("Traffic request rate:", "request_rate", "s"),
    ("Max request concurrency:", "max_concurrency", "conc"),
    ("Successful requests:", "completed", "d"),
    ("Benchmark duration (s):", "duration_s", "f"),
    ("Total input tokens:", "total_input_tokens", "d"),
    ("Total input text tokens:", "total_input_tokens", "d"),
    ("Total generated tokens:", "total_output_tokens", "d"),
    ("Total generated tokens (retokenized):", "total_output_tokens", "d"),
    ("Request throughput (req/s):", "request_throughput", "f"),
    ("Input token throughput (tok/s):", "input_throughput", "f"),
    ("Output token throughput (tok/s):", "output_throughput", "f"),
    ("Peak output token throughput (tok/s):", "peak_output_throughput", "f"),
    ("Peak concurrent requests:", "peak_concurrent_requests", "d"),
    ("Total token throughput (tok/s):", "total_throughput", "f"),
    ("Concurrency:", "achieved_concurrency", "f"),
    ("-", "End-to-End Latency", ""),
    ("Mean E2E Latency (ms):", "mean_e2el_ms", "f"),
    ("Median E2E Latency (ms):", "median_e2el_ms", "f"),
    ("P90 E2E Latency (ms):", "p90_e2el_ms", "f"),
    ("P99 E2E Latency (ms):", "p99_e2el_ms", "f"),
    ("-", "Time to First Token", ""),
    ("Mean TTFT (ms):", "mean_ttft_ms", "f"),
    ("Median TTFT (ms):", "median_ttft_ms", "f"),
    ("P99 TTFT (ms):", "p99_ttft_ms", "f"),
    ("-", "Time per Output Token (excl. 1st token)", ""),
    ("Mean TPOT (ms):", "mean_tpot_ms", "f"),
    ("Median TPOT (ms):", "median_tpot_ms", "f"),
    ("P99 TPOT (ms):", "p99_tpot_ms", "f"),
    ("-", "Inter-Token Latency", ""),
    ("Mean ITL (ms):", "mean_itl_ms", "f"),
    ("Median ITL (ms):", "median_itl_ms", "f"),
    ("P95 ITL (ms):", "p95_itl_ms", "f"),
    ("P99 ITL (ms):", "p99_itl_ms", "f"),
    ("Max ITL (ms):", "max_itl_ms", "f"),
)
BLOCK_WIDTH = 50


def _kv(label: str, value: Any, fmt: str) -> str:
    """sglang's ``"{:<40} {:<10}"`` line (``{:<10.2f}`` for floats); a missing value prints "n/a"
    (sglang prints 0.00 for an empty sample list)."""
    if fmt == "conc":
        value = conc_str(value)
    elif value is None or (isinstance(value, float) and math.isnan(value)):
        value = "n/a"
    elif fmt == "f":
        return f"{label:<40} {float(value):<10.2f}"
    elif fmt == "d":
        value = int(value)
    return f"{label:<40} {value!s:<10}"


def _rule(title: str, char: str = "-") -> str:
    return f"{title:{char}^{BLOCK_WIDTH}}"


def format_sglang_block(row: dict[str, Any]) -> str:
    """sglang.bench_serving's result block for one run (see `SGLANG_BLOCK`)."""
    lines = [_rule(" Serving Benchmark Result ", "=")]
    for label, key, fmt in SGLANG_BLOCK:
        lines.append(_rule(key) if label == "-" else _kv(label, row.get(key), fmt))
    lines.append("=" * BLOCK_WIDTH)
    return "\n".join(lines)


_EXTRA_STATS = (("e2el", "E2E Latency", ("std", "p95", "min", "max")),
                ("ttft", "TTFT", ("std", "p90", "p95", "min", "max")),
                ("tpot", "TPOT", ("std", "p90", "p95", "min", "max")),
                ("itl", "ITL", ("std", "p90", "min")),
                ("itl_chunk", "ITL per chunk", ("mean", "median", "p90", "p99", "max")))


def format_run_detail(row: dict[str, Any]) -> str:
    """`format_sglang_block`, then our rows: what was run, failures, the percentiles sglang does not
    print, per-chunk ITL (vLLM's and sglang-oai's ITL), first-chunk tokens, the consistency checks."""
    lines = [format_sglang_block(row), _rule(" glm-ray ")]
    for label, key, fmt in (("Label:", "label", "s"), ("Model:", "model", "s"), ("Dataset:", "dataset_name", "s"),
                            ("Failed requests:", "failed", "d"),
                            ("Mean tokens in first chunk:", "mean_first_chunk_tokens", "f")):
        lines.append(_kv(label, row.get(key) if row.get(key) != "" else "-", fmt))
    for metric, name, stats in _EXTRA_STATS:
        for st in stats:
            word = st.capitalize() if st in ("mean", "median", "std", "min", "max") else st.upper()
            lines.append(_kv(f"{word} {name} (ms):", row.get(f"{st}_{metric}_ms"), "f"))
    lines.append(_rule("Consistency"))
    for c in row.get("consistency", []):
        if c.get("ok") is None:
            status = f"n/a ({c.get('reason')})"
        else:
            status = (f"{'ok' if c['ok'] else 'FAIL'}: observed {c['observed']:.4g} expected "
                      f"{c['expected']:.4g} (err {c['rel_err'] * 100:.2f}%, tol {c['tolerance'] * 100:.0f}%)")
        lines.append(f"{c['name'] + ':':<40} {status}")
    for err, n in (row.get("errors") or {}).items():
        lines.append(f"error x{n}: {err}")
    lines.append("=" * BLOCK_WIDTH)
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Plots

def _pyplot():
    import matplotlib  # noqa: PLC0415 - matplotlib (the `bench` extra), only to plot
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after selecting the Agg backend
    return plt


def _save_figure(plt, fig, axes, path: str | Path, title: str) -> Path:
    """Legend on the first panel, optional title, tight layout, PNG at `path` (parents created)."""
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def _x(a: AggRow) -> int:
    """x of a point: the max concurrency; without a limit, the number of prompts (all could be in flight)."""
    return a.concurrency if a.concurrency is not None else int(a.values.get("num_prompts") or 1)


def plot_latency(series: dict[str, Sequence[AggRow]], path: str | Path, title: str = "") -> Path:
    """TTFT, ITL and E2EL (mean solid, p99 dashed) vs concurrency, one colour per label."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (metric, name) in zip(axes, (("ttft", "TTFT"), ("itl", "ITL (per token)"), ("e2el", "E2EL"))):
        for i, (label, agg) in enumerate(series.items()):
            xs = [_x(a) for a in agg]
            color = f"C{i}"
            ax.plot(xs, [a.values.get(f"mean_{metric}_ms") for a in agg], "o-", color=color,
                    label=f"{label} mean")
            p99 = [a.values.get(f"p99_{metric}_ms") for a in agg]
            if any(v is not None for v in p99):
                ax.plot(xs, p99, "s--", color=color, alpha=0.6, label=f"{label} p99")
        ax.set_xscale("log", base=2)
        ticks = sorted({_x(a) for agg in series.values() for a in agg})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
    return _save_figure(plt, fig, axes, path, title)


def plot_throughput(series: dict[str, Sequence[AggRow]], path: str | Path, title: str = "") -> Path:
    """Output tok/s against mean ITL and against mean E2EL; points annotated with the concurrency."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, (metric, name) in zip(axes, (("itl", "mean ITL (ms)"), ("e2el", "mean E2EL (ms)"))):
        for i, (label, agg) in enumerate(series.items()):
            pts = [(a.values.get(f"mean_{metric}_ms"), a.values.get("output_throughput"), conc_str(a.concurrency))
                   for a in agg]
            pts = [p for p in pts if p[0] is not None and p[1] is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=f"C{i}", label=label)
            for x, y, c in pts if i == 0 else ():     # label the points of the first series only
                ax.annotate(f"C={c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.margins(0.1)
        ax.set_xlabel(name)
        ax.set_ylabel("output tok/s")
        ax.set_title(f"output throughput vs {name.split(' ')[1]}")
        ax.grid(True, alpha=0.3)
    return _save_figure(plt, fig, axes, path, title)


def write_plots(series: dict[str, Sequence[AggRow]], prefix: str | Path, title: str = "") -> list[Path]:
    """Both PNGs: ``{prefix}_latency.png`` and ``{prefix}_throughput.png``."""
    prefix = str(prefix)
    return [plot_latency(series, prefix + "_latency.png", title),
            plot_throughput(series, prefix + "_throughput.png", title)]
