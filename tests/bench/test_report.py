"""Reports: JSONL round trip, aggregation over repetitions, the PR B table and delta table
(from two saved runs, through the CLI too), and the PNG plots."""
import math

import pytest

from glm_ray.bench import cli, report
from glm_ray.bench.metrics import RequestRecord, summarize

# origin PR B, MI355X TP4: concurrency -> (TTFT ms, ITL ms, E2EL ms, output tok/s)
PR_B_OFF = {4: (199.0, 11.81, 12293, 333.1), 8: (257.1, 13.70, 14312, 572.0), 16: (525.0, 16.40, 17338, 942.1),
            32: (755.4, 20.35, 21900, 1498.0), 64: (1176.8, 27.08, 29723, 2205.8)}
PR_B_ON = {4: (197.2, 11.81, 12283, 332.9), 8: (255.4, 13.69, 14310, 572.2), 16: (498.8, 16.39, 17291, 946.9),
           32: (716.0, 20.25, 21781, 1505.6), 64: (1110.5, 27.05, 29630, 2210.5)}


def row(label, c, rep, vals, scale=1.0):
    ttft, itl, e2el, tput = (v * scale for v in vals)
    cfg = {"label": label, "model": "glm-5.2", "input_len": 1024, "output_len": 1024, "range_ratio": 1.0,
           "max_concurrency": c, "num_prompts": 4 * c, "request_rate": math.inf, "repetition": rep,
           "itl_semantics": "sglang-native"}
    metrics = {"completed": 4 * c, "failed": 0, "mean_ttft_ms": ttft, "mean_itl_ms": itl, "mean_e2el_ms": e2el,
               "output_throughput": tput, "p99_ttft_ms": ttft * 1.5, "p99_itl_ms": itl * 1.2,
               "p99_e2el_ms": e2el * 1.01, "consistent": True, "consistency": []}
    return report.result_row(cfg, metrics)


def write_runs(path, label, table, reps=3, outlier=False):
    """One rep per point at the table value, or three (0.99x, 1.00x, 1.01x) whose mean is the value."""
    for c, vals in table.items():
        for rep, scale in enumerate((1.0,) if reps == 1 else (0.99, 1.0, 1.01)):
            report.append_jsonl(path, row(label, c, rep, vals, scale))
        if outlier:
            report.append_jsonl(path, row(label, c, 3, vals, 0.5))
    return path


def test_jsonl_roundtrip_and_strict_json(tmp_path):
    p = write_runs(tmp_path / "a.jsonl", "fp8_proj=off", {4: PR_B_OFF[4]}, reps=1)
    text = p.read_text()
    assert "Infinity" not in text and '"request_rate": "inf"' in text
    rows = report.load_jsonl(p)
    assert rows[0]["schema"] == report.SCHEMA and rows[0]["mean_ttft_ms"] == 199.0
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        report.load_jsonl(tmp_path / "bad.jsonl")


def test_real_summary_serialises(tmp_path):
    recs = [RequestRecord(prompt_len=4, max_tokens=2, start=0.0, end=0.2, chunk_times=[0.1, 0.2],
                          chunk_tokens=[1, 1], output_len=2, tokens_from_usage=True, success=True)]
    s = summarize(recs, duration_s=0.2, t0=0.0, max_concurrency=1)
    r = report.result_row({"label": "x", "max_concurrency": 1, "request_rate": math.inf}, s.to_dict())
    report.append_jsonl(tmp_path / "r.jsonl", r)
    back = report.load_jsonl(tmp_path / "r.jsonl")[0]
    assert back["mean_ttft_ms"] == pytest.approx(100.0) and back["consistent"] is True
    assert "Serving Benchmark Result" in report.format_run_detail(back)
    assert "C=1" in report.format_run_line(back)


def test_aggregate_mean_median_and_outlier(tmp_path):
    p = write_runs(tmp_path / "a.jsonl", "off", PR_B_OFF, outlier=True)
    rows = report.load_jsonl(p)
    agg = report.aggregate(rows, "mean", drop_outlier=True)
    assert [a.concurrency for a in agg] == [4, 8, 16, 32, 64]
    assert all(a.reps == 3 and a.dropped == 1 for a in agg)
    assert agg[0].values["mean_ttft_ms"] == pytest.approx(199.0)
    assert agg[-1].values["output_throughput"] == pytest.approx(2205.8)
    agg = report.aggregate(rows, "mean")           # outlier kept: mean pulled down
    assert agg[0].reps == 4 and agg[0].values["mean_ttft_ms"] == pytest.approx(199.0 * 3.5 / 4)
    agg = report.aggregate(rows, "median")
    assert agg[0].values["mean_ttft_ms"] == pytest.approx(199.0 * 0.995)


def test_table_matches_pr_b(tmp_path):
    agg = report.aggregate(report.load_jsonl(write_runs(tmp_path / "a.jsonl", "off", PR_B_OFF)))
    text = report.format_table(agg)
    lines = text.splitlines()
    assert lines[0].split() == ["concurrency", "TTFT", "(ms)", "ITL", "(ms)", "E2EL", "(ms)", "output", "tok/s"]
    assert lines[2].split() == ["4", "199.0", "11.81", "12293", "333.1"]
    assert lines[-1].split() == ["64", "1176.8", "27.08", "29723", "2205.8"]
    md = report.format_table(agg, "markdown").splitlines()
    assert md[0] == "| concurrency | TTFT (ms) | ITL (ms) | E2EL (ms) | output tok/s |"
    assert md[2] == "| 4 | 199.0 | 11.81 | 12293 | 333.1 |"
    assert report.format_table(agg, "tsv").splitlines()[1] == "4\t199.0\t11.81\t12293\t333.1"


def test_compare_table_from_two_saved_runs(tmp_path, capsys):
    a = write_runs(tmp_path / "off.jsonl", "fp8_proj=off", PR_B_OFF)
    b = write_runs(tmp_path / "on.jsonl", "fp8_proj=on", PR_B_ON)
    rc = cli.main(["--compare", str(a), str(b), "--format", "tsv"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "A. Baseline (fp8_proj=off):" in out and "B. fp8_proj=on (\u0394 vs baseline):" in out
    lines = out.splitlines()
    start = lines.index("B. fp8_proj=on (\u0394 vs baseline):")
    header = lines[start + 1].split("\t")
    assert header == ["concurrency", "TTFT (ms)", "\u0394", "ITL (ms)", "\u0394", "E2EL (ms)", "\u0394",
                      "output tok/s", "\u0394"]
    m = "\u2212"
    # PR B's own deltas (it shows -0.0% for ITL at C=4 from unrounded data; ours are from the table values)
    assert lines[start + 2].split("\t") == ["4", "197.2", f"{m}0.9%", "11.81", "+0.0%", "12283", f"{m}0.1%",
                                            "332.9", f"{m}0.1%"]
    assert lines[start + 4].split("\t") == ["16", "498.8", f"{m}5.0%", "16.39", f"{m}0.1%", "17291", f"{m}0.3%",
                                            "946.9", "+0.5%"]
    assert lines[start + 6].split("\t") == ["64", "1110.5", f"{m}5.6%", "27.05", f"{m}0.1%", "29630", f"{m}0.3%",
                                            "2210.5", "+0.2%"]
    assert "WARNING" not in out


def test_compare_warns_on_config_mismatch_and_missing_points(tmp_path, capsys):
    a = write_runs(tmp_path / "a.jsonl", "a", {4: PR_B_OFF[4]}, reps=1)
    b = tmp_path / "b.jsonl"
    r = row("b", 8, 0, PR_B_ON[8])
    r["output_len"] = 512
    report.append_jsonl(b, r)
    assert cli.main(["--compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "WARNING: output_len differs" in out
    b_row = [ln for ln in out.splitlines() if "572.2" in ln][0].split()
    assert b_row == ["8", "255.4", "-", "13.69", "-", "14310", "-", "572.2", "-"]   # unmatched: no delta


def test_compare_missing_file_is_a_clean_error(tmp_path, capsys):
    assert cli.main(["--compare", str(tmp_path / "nope.jsonl"), str(tmp_path / "nope2.jsonl")]) == 2
    assert "error" in capsys.readouterr().err


def _is_png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image as mpimg
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 400
    return True


def test_plots_are_pngs(tmp_path, capsys):
    a = write_runs(tmp_path / "off.jsonl", "fp8_proj=off", PR_B_OFF)
    b = write_runs(tmp_path / "on.jsonl", "fp8_proj=on", PR_B_ON)
    series = {"off": report.aggregate(report.load_jsonl(a)), "on": report.aggregate(report.load_jsonl(b))}
    paths = report.write_plots(series, tmp_path / "plots" / "cmp", "fp8_proj")
    assert [p.name for p in paths] == ["cmp_latency.png", "cmp_throughput.png"]
    assert all(_is_png(p) for p in paths)
    # --report re-renders a saved run: table on stdout, plots next to the file
    assert cli.main(["--report", str(a)]) == 0
    out = capsys.readouterr().out
    assert "1176.8" in out and "mean of 3 rep(s)" in out
    assert _is_png(tmp_path / "off_latency.png") and _is_png(tmp_path / "off_throughput.png")
    # --compare with --plot-prefix draws both series
    assert cli.main(["--compare", str(a), str(b), "--plot-prefix", str(tmp_path / "ab")]) == 0
    assert _is_png(tmp_path / "ab_latency.png")


# sglang.bench_serving's "Serving Benchmark Result" block, as its benchmark() prints it (2025-26; the
# optional rows it prints only for image datasets and speculative decoding left out)
SGLANG_BLOCK = """\
============ Serving Benchmark Result ============
Backend:
Traffic request rate:
Max request concurrency:
Successful requests:
Benchmark duration (s):
Total input tokens:
Total input text tokens:
Total generated tokens:
Total generated tokens (retokenized):
Request throughput (req/s):
Input token throughput (tok/s):
Output token throughput (tok/s):
Peak output token throughput (tok/s):
Peak concurrent requests:
Total token throughput (tok/s):
Concurrency:
----------------End-to-End Latency----------------
Mean E2E Latency (ms):
Median E2E Latency (ms):
P90 E2E Latency (ms):
P99 E2E Latency (ms):
---------------Time to First Token----------------
Mean TTFT (ms):
Median TTFT (ms):
P99 TTFT (ms):
-----Time per Output Token (excl. 1st token)------
Mean TPOT (ms):
Median TPOT (ms):
P99 TPOT (ms):
---------------Inter-Token Latency----------------
Mean ITL (ms):
Median ITL (ms):
P95 ITL (ms):
P99 ITL (ms):
Max ITL (ms):
==================================================""".splitlines()


def _real_row():
    recs = [RequestRecord(prompt_len=4, max_tokens=3, start=0.0, end=0.3 + 0.1 * i,
                          chunk_times=[0.1, 0.2 + 0.05 * i, 0.3 + 0.1 * i], chunk_tokens=[1, 1, 1], output_len=3,
                          tokens_from_usage=True, success=True) for i in range(4)]
    s = summarize(recs, duration_s=0.7, t0=0.0, max_concurrency=4)
    return report.result_row({"label": "x", "backend": "sglang-oai", "model": "m", "max_concurrency": 4,
                              "request_rate": math.inf, "dataset_name": "random"}, s.to_dict())


def test_result_block_has_sglangs_rows_in_sglangs_layout(tmp_path):
    report.append_jsonl(tmp_path / "r.jsonl", _real_row())
    row = report.load_jsonl(tmp_path / "r.jsonl")[0]
    lines = report.format_sglang_block(row).splitlines()
    labels = [ln if ln[:1] in "=-" else ln[:40].rstrip() for ln in lines]
    assert labels == SGLANG_BLOCK
    by_label = {ln[:40].rstrip(): ln for ln in lines}
    # "{:<40} {:<10}" / "{:<40} {:<10.2f}": label padded to 40, a space, the value padded to 10
    assert by_label["Successful requests:"] == "Successful requests:".ljust(40) + " " + "4".ljust(10)
    assert by_label["Traffic request rate:"] == "Traffic request rate:".ljust(40) + " inf       "
    assert by_label["Max request concurrency:"].split(None, 3)[-1].strip() == "4"
    assert by_label["Benchmark duration (s):"].endswith(" 0.70      ")
    assert by_label["Total input tokens:"].split()[-1] == "16" and by_label["Total generated tokens:"].split()[-1] == "12"
    assert by_label["Mean TTFT (ms):"].split()[-1] == "100.00"
    assert by_label["Mean E2E Latency (ms):"].split()[-1] == "450.00"       # (300 + 400 + 500 + 600) / 4
    assert float(by_label["Concurrency:"].split()[-1]) == pytest.approx(1.8 / 0.7, abs=0.005)
    # our rows come after sglang's closing rule
    detail = report.format_run_detail(row).splitlines()
    assert detail[:len(lines)] == lines and "Failed requests:" in "\n".join(detail[len(lines):])
    assert any(ln.startswith("e2el_tpot:") for ln in detail)


def test_result_row_carries_sglangs_output_file_keys():
    row = _real_row()
    assert row["duration"] == row["duration_s"] == 0.7 and row["completed"] == 4
    assert row["mean_e2e_latency_ms"] == row["mean_e2el_ms"] and row["p99_e2e_latency_ms"] == row["p99_e2el_ms"]
    assert row["concurrency"] == row["achieved_concurrency"]
    assert row["max_output_tokens_per_s"] == row["peak_output_throughput"]
    assert row["max_concurrent_requests"] == row["peak_concurrent_requests"] == 4
    for k in ("total_input_tokens", "total_output_tokens", "request_throughput", "input_throughput",
              "output_throughput", "total_throughput", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms",
              "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p95_itl_ms",
              "p99_itl_ms", "backend", "dataset_name", "request_rate", "max_concurrency"):
        assert k in row, k


def test_no_concurrency_limit_prints_not_set(tmp_path):
    r = row("unlimited", 4, 0, PR_B_OFF[4])
    r["max_concurrency"] = None
    agg = report.aggregate([r, row("limited", 8, 0, PR_B_OFF[8])])
    assert [a.concurrency for a in agg] == [8, None]
    assert report.format_table(agg).splitlines()[-1].split()[:2] == ["not", "set"]
    assert "Max request concurrency:".ljust(40) + " not set" in report.format_sglang_block(r)
    report.write_plots({"a": agg}, tmp_path / "p")
