"""bench/lifetimes.py: the served A/B over several server lifetimes per setting (issue #20 measure 2's table)."""
from __future__ import annotations

import json

import pytest

from glm_ray.bench import lifetimes as lt
from glm_ray.bench.report import aggregate, load_jsonl


def _write(path, label, values):
    """values: {C: [(ttft, itl) per repetition]} -> a glm-ray bench result file."""
    with open(path, "w") as f:
        for c, reps in values.items():
            for i, (ttft, itl) in enumerate(reps):
                f.write(json.dumps({"label": label, "max_concurrency": c, "repetition": i,
                                    "mean_ttft_ms": ttft, "mean_itl_ms": itl}) + "\n")
    return str(path)


def test_means_spreads_delta_and_verdict(tmp_path):
    # PR B's order: off / on / on / off / off / on; C=4 two repetitions in lifetime 1 (averaged first)
    spec = [("off", {4: [(100.0, 10.0), (104.0, 10.0)], 8: [(200.0, 20.0)]}),
            ("on", {4: [(90.0, 10.1)], 8: [(199.0, 20.0)]}),
            ("on", {4: [(92.0, 9.9)], 8: [(205.0, 20.2)]}),
            ("off", {4: [(101.0, 10.2)], 8: [(198.0, 19.8)]}),
            ("off", {4: [(103.0, 9.8)], 8: [(210.0, 20.4)]}),
            ("on", {4: [(94.0, 10.0)], 8: [(201.0, 20.1)]})]
    files = [_write(tmp_path / f"prb_{i + 1}_{f}.jsonl", f"fp8_proj={f}", v) for i, (f, v) in enumerate(spec)]
    lts = [lt.load_lifetime(p) for p in files]
    settings, rows = lt.compare(lts)
    assert settings == ["fp8_proj=off", "fp8_proj=on"]
    by = {(r.concurrency, r.metric): r for r in rows}
    r4 = by[(4, "mean_ttft_ms")]
    assert r4.per_lifetime == [102.0, 90.0, 92.0, 101.0, 103.0, 94.0]
    off, on = (102.0 + 101.0 + 103.0) / 3, (90.0 + 92.0 + 94.0) / 3
    assert r4.means == pytest.approx({"fp8_proj=off": off, "fp8_proj=on": on})
    assert r4.spreads == pytest.approx({"fp8_proj=off": 2.0, "fp8_proj=on": 4.0})
    assert r4.delta_pct == pytest.approx((on - off) / off * 100)
    assert r4.clear is True                               # |delta| 10 ms > the larger spread, 4 ms
    r8 = by[(8, "mean_ttft_ms")]                          # on 201.67 vs off 202.67: inside spreads of 6 / 12
    assert r8.clear is False
    text = lt.format_rows(lts, settings, rows)
    assert "prb_1_off (fp8_proj=off)" in text and "yes" in text and "no" in text


def test_one_lifetime_per_setting_agrees_with_the_compare_report(tmp_path):
    """Two result files, one lifetime each: no spread (verdict n/a), and the delta is the one `glm-ray bench
    --compare` computes from the same files (report.aggregate, an independent path)."""
    a = _write(tmp_path / "a.jsonl", "x=off", {4: [(120.0, 12.0), (130.0, 13.0)], 16: [(300.0, 20.0)]})
    b = _write(tmp_path / "b.jsonl", "x=on", {4: [(110.0, 12.5)], 16: [(330.0, 21.0)]})
    settings, rows = lt.compare([lt.load_lifetime(a), lt.load_lifetime(b)])
    agg_a = {r.concurrency: r for r in aggregate(load_jsonl(a))}
    agg_b = {r.concurrency: r for r in aggregate(load_jsonl(b))}
    for r in rows:
        assert r.clear is None
        if r.metric == "mean_ttft_ms":
            ta, tb = agg_a[r.concurrency].values["mean_ttft_ms"], agg_b[r.concurrency].values["mean_ttft_ms"]
            assert r.delta_pct == pytest.approx((tb - ta) / ta * 100)


def test_bad_inputs_are_clear_errors(tmp_path, capsys):
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({"label": "a", "max_concurrency": 4, "mean_ttft_ms": 1.0}) + "\n"
                     + json.dumps({"label": "b", "max_concurrency": 4, "mean_ttft_ms": 1.0}) + "\n")
    with pytest.raises(ValueError, match="one setting label"):
        lt.load_lifetime(mixed)
    one = _write(tmp_path / "one.jsonl", "a", {4: [(1.0, 1.0)]})
    assert lt.main([one, one]) == 2 and "exactly two settings" in capsys.readouterr().err


def test_baseline_and_a_concurrency_one_lifetime_lacks(tmp_path):
    """The delta is against --baseline whatever the files' order; a C missing from one lifetime (its leg timed
    out) keeps its row, means and spreads over the lifetimes that have it; a C one setting lacks entirely is
    dropped."""
    spec = [("on", {4: [(90.0, 10.0)], 64: [(400.0, 30.0)]}),
            ("off", {4: [(100.0, 10.0)]}),                           # no C=64: timed out
            ("off", {4: [(104.0, 10.0)], 64: [(440.0, 30.0)]}),
            ("on", {4: [(94.0, 10.0)], 64: [(420.0, 31.0)], 128: [(900.0, 40.0)]})]
    files = [_write(tmp_path / f"l{i}_{f}.jsonl", f"fp8_proj={f}", v) for i, (f, v) in enumerate(spec)]
    lts = [lt.load_lifetime(p) for p in files]
    settings, rows = lt.compare(lts, baseline="fp8_proj=off")
    assert settings == ["fp8_proj=off", "fp8_proj=on"]
    by = {(r.concurrency, r.metric): r for r in rows}
    assert {c for c, _ in by} == {4, 64}
    r4 = by[(4, "mean_ttft_ms")]
    assert r4.delta_pct == pytest.approx((92.0 - 102.0) / 102.0 * 100) and r4.clear is True
    r64 = by[(64, "mean_ttft_ms")]
    assert r64.per_lifetime == [400.0, None, 440.0, 420.0]
    assert r64.means == pytest.approx({"fp8_proj=off": 440.0, "fp8_proj=on": 410.0})
    assert r64.spreads == pytest.approx({"fp8_proj=off": 0.0, "fp8_proj=on": 20.0})
    assert r64.clear is None                                  # one off lifetime left at C=64: no spread
    assert "-" in lt.format_rows(lts, settings, rows).splitlines()[-2].split()
    assert lt.main(files + ["--baseline", "x=1"]) == 2


def test_paired_deltas_follow_the_abba_pairs(tmp_path):
    """PR B's order off/on/on/off/off/on pairs as (1, 2), (3, 4), (5, 6); each pair's delta is on vs off inside it,
    whichever comes first; a drift that lifts later lifetimes cancels inside a pair."""
    ttft = [100.0, 95.0, 105.0, 110.0, 120.0, 114.0]           # a drift of +10 per pair, on 5% below off in each
    spec = zip(["off", "on", "on", "off", "off", "on"], ttft)
    files = [_write(tmp_path / f"l{i}_{f}.jsonl", f"fp8_proj={f}", {4: [(t, 10.0)]}) for i, (f, t) in enumerate(spec)]
    lts = [lt.load_lifetime(p) for p in files]
    settings, rows = lt.compare(lts, baseline="fp8_proj=off")
    r = {(x.concurrency, x.metric): x for x in rows}[(4, "mean_ttft_ms")]
    assert r.paired == pytest.approx([-5.0, (105.0 - 110.0) / 110.0 * 100, -5.0])
    assert r.clear is False                                    # the drift makes the spreads larger than the delta
    text = lt.format_rows(lts, settings, rows)
    assert "-5.0 / -4.5 / -5.0" in text and text.splitlines()[2].split()[-1] == "yes"
