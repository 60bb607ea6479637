"""A short `glm-ray bench` run against the served tiny app (fixture `tiny_server` from tests/conftest.py:
session scoped, with `.base_url` and `.model`). C=2, 4 prompts, input 16, output 8.

Tolerance of the consistency checks here: 25 % (TOL). The tiny app runs on 2 CPU cores behind Ray Serve,
so step times jitter and two short waves are far from steady state; on a GPU run the default is 5 %.
"""
from glm_ray.bench import cli, report

TOL = 0.25
INPUT_LEN, OUTPUT_LEN, CONC, N = 16, 8, 2, 4


def test_short_run_against_tiny_app(tiny_server, tmp_path, capsys):
    result = tmp_path / "live.jsonl"
    argv = ["--base-url", tiny_server.base_url, "--model", tiny_server.model,
            "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--concurrency", str(CONC),
            "--num-prompts", str(N), "--warmup-requests", "1", "--warmup-pause", "0",
            "--request-timeout", "120", "--tolerance", str(TOL), "--label", "live",
            "--result-file", str(result), "--save-requests", "--no-progress"]
    vocab = getattr(tiny_server, "vocab_size", None)
    if vocab:
        argv += ["--vocab-size", str(vocab)]
    rc = cli.main(argv)
    out = capsys.readouterr().out
    assert rc == 0, out

    (row,) = report.load_jsonl(result)
    assert row["model"] == tiny_server.model and row["max_concurrency"] == CONC and row["num_prompts"] == N
    # every request succeeded and produced exactly max_tokens tokens (ignore_eos)
    assert row["completed"] == N and row["failed"] == 0, row["errors"]
    assert row["output_len_matches_request"]
    assert row["total_output_tokens"] == N * OUTPUT_LEN
    assert row["total_input_tokens"] == N * INPUT_LEN
    assert row["min_ttft_ms"] > 0 and row["mean_e2el_ms"] > row["mean_ttft_ms"]
    assert row["mean_tpot_ms"] > 0 and row["mean_itl_ms"] > 0
    assert row["output_throughput"] > 0 and row["peak_concurrent_requests"] <= CONC

    checks = {c["name"]: c for c in row["consistency"]}
    for name in ("e2el_tpot", "e2el_itl", "steady_throughput"):
        assert checks[name]["ok"] is True, checks[name]

    reqs = report.load_jsonl(tmp_path / "live_requests.jsonl")
    assert len(reqs) == N
    for r in reqs:
        assert r["success"] and r["output_len"] == OUTPUT_LEN and r["prompt_len"] == INPUT_LEN
        assert r["chunk_times"][0] > r["start"] and r["end"] >= r["chunk_times"][-1]

    assert (tmp_path / "live_latency.png").read_bytes()[:4] == b"\x89PNG"
    assert "concurrency" in out and "TTFT (ms)" in out
