"""Serving-benchmark reports: JSONL results, tables, the A-vs-B delta table, and PNG plots.

This module owns everything a person reads or a later run loads back:

- `result_row` / `append_jsonl` / `load_jsonl`: one JSON object per (concurrency, repetition) run,
  holding the run's config and every `metrics.RunSummary` field (sglang-style keys such as
  ``mean_ttft_ms``, ``p99_e2el_ms``, ``output_throughput``).
- `aggregate`: mean (or median) over repetitions per concurrency, optionally dropping the single
  run furthest from the median output throughput (origin PR B dropped one outlier per point).
- `format_table` / `format_compare`: the table shape of origin PR B (concurrency, TTFT, ITL, E2EL,
  output tok/s; the compare table adds a delta column after each), as aligned text, markdown or TSV.
- `format_run_detail`: an sglang-style block for one run; `format_run_line`: one line per run.
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


def result_row(config: dict[str, Any], summary_dict: dict[str, Any]) -> dict[str, Any]:
    """One JSONL line: schema tag, the run's config, then the flat summary metrics.

    An infinite request rate is written as the string "inf"; other non-finite numbers as null.
    """
    row: dict[str, Any] = {"schema": SCHEMA}
    row.update({k: _json_float(v) for k, v in config.items()})
    row.update(_finite(summary_dict))
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

    concurrency: int
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
        key = (int(r["max_concurrency"]), r.get("input_len"), r.get("output_len"))
        groups.setdefault(key, []).append(r)
    out = []
    for (c, il, ol), runs in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1:]))):
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
    body = [[str(a.concurrency)] + [_fmt(a.values.get(k), d) for k, _, d in TABLE_COLUMNS] for a in agg]
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
        row = [str(b.concurrency)]
        for k, _, d in TABLE_COLUMNS:
            row += [_fmt(b.values.get(k), d), _fmt_delta(a.values.get(k) if a else None, b.values.get(k))]
        body.append(row)
    return render(header, body, fmt)


def describe_rows(rows: Sequence[dict[str, Any]]) -> str:
    """One line naming what a results file measured (label, model, lengths, reps)."""
    r0 = rows[0]
    labels = sorted({str(r.get("label") or "") for r in rows} - {""})
    reps = max(int(r.get("repetition", 0)) for r in rows) + 1
    return (f"{', '.join(labels) or 'unlabelled'}: model={r0.get('model')} "
            f"input={r0.get('input_len')} output={r0.get('output_len')} "
            f"range_ratio={r0.get('range_ratio')} rate={r0.get('request_rate')} reps={reps}")


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
    bad = [str(a.concurrency) for a in agg if not a.consistent]
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
    return (f"C={row.get('max_concurrency')!s:<3} rep {int(row.get('repetition') or 0) + 1}: "
            f"{done}/{done + failed} ok  "
            f"TTFT {_fmt(row.get('mean_ttft_ms'), 1)} ms  ITL {_fmt(row.get('mean_itl_ms'), 2)} ms  "
            f"E2EL {_fmt(row.get('mean_e2el_ms'), 0)} ms  out {_fmt(row.get('output_throughput'), 1)} tok/s  "
            f"[{cons}]")


def format_run_detail(row: dict[str, Any]) -> str:
    """sglang-style result block for one run, plus the consistency checks."""
    w = 46

    def kv(name: str, value: Any, d: int = 2) -> str:
        if isinstance(value, float):
            v = _fmt(value, d)
        else:
            v = "-" if value is None else str(value)
        return f"{name + ':':<{w}}{v}"

    def sep(title: str) -> str:
        return f"{title:-^{w + 10}}"

    lines = [f"{' Serving Benchmark Result ':=^{w + 10}}",
             kv("Label", row.get("label") or "-"), kv("Model", row.get("model")),
             kv("Traffic request rate", row.get("request_rate")),
             kv("Max request concurrency", row.get("max_concurrency")),
             kv("Successful requests", row.get("completed")), kv("Failed requests", row.get("failed")),
             kv("Benchmark duration (s)", row.get("duration_s")),
             kv("Total input tokens", row.get("total_input_tokens")),
             kv("Total generated tokens", row.get("total_output_tokens")),
             kv("Request throughput (req/s)", row.get("request_throughput")),
             kv("Input token throughput (tok/s)", row.get("input_throughput")),
             kv("Output token throughput (tok/s)", row.get("output_throughput")),
             kv("Peak output token throughput (tok/s)", row.get("peak_output_throughput")),
             kv("Peak concurrent requests", row.get("peak_concurrent_requests")),
             kv("Total token throughput (tok/s)", row.get("total_throughput")),
             kv("Concurrency (sum E2EL / duration)", row.get("achieved_concurrency")),
             kv("Mean tokens in first chunk", row.get("mean_first_chunk_tokens"))]
    for metric, title in (("e2el", "End-to-End Latency"), ("ttft", "Time to First Token"),
                          ("tpot", "Time per Output Token (excl. 1st token)"),
                          ("itl", "Inter-token Latency (per token)"),
                          ("itl_chunk", "Inter-chunk Latency (per chunk)")):
        lines.append(sep(title))
        for s in ("mean", "median", "p90", "p99", "max"):
            lines.append(kv(f"{s.capitalize() if s in ('mean', 'median', 'max') else s.upper()} "
                            f"{metric.upper()} (ms)", row.get(f"{s}_{metric}_ms")))
    lines.append(sep("Consistency"))
    for c in row.get("consistency", []):
        if c.get("ok") is None:
            status = f"n/a ({c.get('reason')})"
        else:
            status = (f"{'ok' if c['ok'] else 'FAIL'}: observed {c['observed']:.4g} expected "
                      f"{c['expected']:.4g} (err {c['rel_err'] * 100:.2f}%, tol {c['tolerance'] * 100:.0f}%)")
        lines.append(f"{c['name'] + ':':<{w}}{status}")
    for err, n in (row.get("errors") or {}).items():
        lines.append(f"error x{n}: {err}")
    lines.append("=" * (w + 10))
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


def plot_latency(series: dict[str, Sequence[AggRow]], path: str | Path, title: str = "") -> Path:
    """TTFT, ITL and E2EL (mean solid, p99 dashed) vs concurrency, one colour per label."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (metric, name) in zip(axes, (("ttft", "TTFT"), ("itl", "ITL (per token)"), ("e2el", "E2EL"))):
        for i, (label, agg) in enumerate(series.items()):
            xs = [a.concurrency for a in agg]
            color = f"C{i}"
            ax.plot(xs, [a.values.get(f"mean_{metric}_ms") for a in agg], "o-", color=color,
                    label=f"{label} mean")
            p99 = [a.values.get(f"p99_{metric}_ms") for a in agg]
            if any(v is not None for v in p99):
                ax.plot(xs, p99, "s--", color=color, alpha=0.6, label=f"{label} p99")
        ax.set_xscale("log", base=2)
        ticks = sorted({a.concurrency for agg in series.values() for a in agg})
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
            pts = [(a.values.get(f"mean_{metric}_ms"), a.values.get("output_throughput"), a.concurrency)
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
