"""A served A/B whose legs ran in several server lifetimes: is the flag's effect larger than the spread
between lifetimes of one setting? (issue #20 measure 2, origin PR B's protocol: 3 lifetimes per flag,
interleaved off/on/on/off/off/on, `glm-ray bench` at C = 4..64 in each.)

    python -m glm_ray.bench.lifetimes prb_1_off.jsonl prb_2_on.jsonl ... [--baseline fp8_proj=off]
        [--metrics mean_ttft_ms mean_itl_ms]

Each file is one server lifetime (`glm-ray bench --result-file` rows; several repetitions in a file are
averaged first); its setting is the rows' `label` (e.g. `fp8_proj=on`). Per concurrency and metric the table
gives every lifetime's value in file order, then per setting the mean over its lifetimes and the spread
(max - min over them), and the delta of the other setting's mean against the baseline's in percent (the
baseline: `--baseline`, else the first file's setting). `clear` says whether |delta| exceeds the larger of the
two spreads — the issue's criterion for an attributable effect (with one lifetime per setting there is no
spread and the verdict is "n/a"). `paired` is the ABBA view of the same lifetimes: the lifetimes taken two by
two in file order (1+2, 3+4, 5+6: PR B's off/on, on/off, off/on), each pair of two settings gives the other
setting's delta against the baseline within that pair, so a drift between server lifetimes cancels; `same sign`
says whether every pair's delta points the same way. A concurrency some lifetime lacks (its leg ran out of time) keeps its row:
"-" in that lifetime's column, means and spreads over the lifetimes that have it.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean

from glm_ray.bench.report import load_jsonl, render

METRICS = ("mean_ttft_ms", "mean_itl_ms")


@dataclass(frozen=True)
class Lifetime:
    name: str                                # the file's stem
    label: str                               # the setting (the rows' `label`)
    values: dict[tuple[int, str], float]     # (concurrency, metric) -> mean over the file's repetitions


def load_lifetime(path: str | Path, metrics: tuple[str, ...] = METRICS) -> Lifetime:
    """One lifetime's file -> per (C, metric) the mean over its repetitions. All rows must carry one label."""
    rows = load_jsonl(path)
    labels = {r.get("label") for r in rows}
    if len(labels) != 1 or None in labels:
        raise ValueError(f"{path}: one lifetime carries one setting label, found {sorted(map(str, labels))}")
    acc: dict[tuple[int, str], list[float]] = defaultdict(list)
    for r in rows:
        for m in metrics:
            if r.get(m) is not None:
                acc[(int(r["max_concurrency"]), m)].append(float(r[m]))
    return Lifetime(Path(path).stem, labels.pop(), {k: fmean(v) for k, v in acc.items()})


@dataclass(frozen=True)
class Row:
    concurrency: int
    metric: str
    per_lifetime: list[float | None]         # in the order the lifetimes were given (None: that lifetime lacks C)
    means: dict[str, float]                  # setting -> mean over its lifetimes
    spreads: dict[str, float]                # setting -> max - min over its lifetimes (0 with one)
    delta_pct: float | None                  # the other setting's mean vs the baseline's
    clear: bool | None                       # |delta| > the larger spread (None: a setting has one lifetime)
    paired: list[float]                      # per adjacent pair of lifetimes of both settings: its delta (%)


def compare(lifetimes: list[Lifetime], metrics: tuple[str, ...] = METRICS,
            baseline: str | None = None) -> tuple[list[str], list[Row]]:
    """The two settings, baseline first (default: the first lifetime's), and a Row per (C, metric) that
    both settings have in at least one lifetime."""
    settings = list(dict.fromkeys(lt.label for lt in lifetimes))
    if len(settings) != 2:
        raise ValueError(f"need lifetimes of exactly two settings, got {settings}")
    if baseline is not None:
        if baseline not in settings:
            raise ValueError(f"baseline {baseline!r} is none of the lifetimes' settings {settings}")
        settings.sort(key=lambda s: s != baseline)
    keys = sorted({k for lt in lifetimes for k in lt.values}, key=lambda k: (k[0], metrics.index(k[1])))
    rows = []
    for c, m in keys:
        by = {s: [lt.values[(c, m)] for lt in lifetimes if lt.label == s and (c, m) in lt.values] for s in settings}
        if not all(by.values()):
            continue
        means = {s: fmean(v) for s, v in by.items()}
        spreads = {s: max(v) - min(v) for s, v in by.items()}
        a, b = means[settings[0]], means[settings[1]]
        delta = _pct(a, b)
        several = all(len(v) > 1 for v in by.values())
        clear = (abs(b - a) > max(spreads.values())) if several else None
        rows.append(Row(c, m, [lt.values.get((c, m)) for lt in lifetimes], means, spreads, delta, clear,
                        _paired(lifetimes, settings, (c, m))))
    return settings, rows


def _paired(lifetimes: list[Lifetime], settings: list[str], key: tuple[int, str]) -> list[float]:
    """Lifetimes (0, 1), (2, 3), ... of different settings that both have `key`: the other setting's value vs
    the baseline's within each pair, in percent."""
    out = []
    for a, b in zip(lifetimes[0::2], lifetimes[1::2]):
        if a.label == b.label or key not in a.values or key not in b.values:
            continue
        base, other = (a, b) if a.label == settings[0] else (b, a)
        d = _pct(base.values[key], other.values[key])
        if d is not None:
            out.append(d)
    return out


def _pct(base: float, other: float) -> float | None:
    """`other` against `base` in percent (None when base is 0)."""
    return (other - base) / base * 100.0 if base else None


def format_rows(lifetimes: list[Lifetime], settings: list[str], rows: list[Row], fmt: str = "text") -> str:
    header = ["C", "metric"] + [f"{lt.name} ({lt.label})" for lt in lifetimes]
    for s in settings:
        header += [f"{s} mean", f"{s} spread"]
    header += ["delta %", "clear", "paired deltas %", "same sign"]
    body = []
    for r in rows:
        line = [str(r.concurrency), r.metric] + ["-" if v is None else f"{v:.2f}" for v in r.per_lifetime]
        for s in settings:
            line += [f"{r.means[s]:.2f}", f"{r.spreads[s]:.2f}"]
        line += [f"{r.delta_pct:+.2f}" if r.delta_pct is not None else "-",
                 {True: "yes", False: "no", None: "n/a"}[r.clear],
                 " / ".join(f"{d:+.1f}" for d in r.paired) or "-",
                 ("yes" if len({d > 0 for d in r.paired}) == 1 else "no") if len(r.paired) > 1 else "n/a"]
        body.append(line)
    return render(header, body, fmt)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="one glm-ray bench result file per server lifetime")
    p.add_argument("--baseline", help="the setting the delta is taken against (default: the first file's)")
    p.add_argument("--metrics", nargs="+", default=list(METRICS))
    p.add_argument("--format", choices=["text", "markdown"], default="text")
    args = p.parse_args(argv)
    metrics = tuple(args.metrics)
    try:
        lts = [load_lifetime(f, metrics) for f in args.files]
        settings, rows = compare(lts, metrics, args.baseline)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_rows(lts, settings, rows, args.format))
    return 0


if __name__ == "__main__":
    sys.exit(main())
