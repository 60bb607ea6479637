"""Short `glm-ray bench` runs against the served tiny app (fixture `tiny_server` from tests/conftest.py:
session scoped, with `.base_url` and `.model`): our flags (C=2, 4 prompts, input 16, output 8, fixed
lengths), the command sglang.bench_serving / `vllm bench serve` users copy, run as written, and a
ShareGPT file tokenized by the server's /tokenize.

Tolerance of the consistency checks here: 25 % (TOL). The tiny app runs on 2 CPU cores behind Ray Serve,
so step times jitter and two short waves are far from steady state; on a GPU run the default is 5 %.
"""
import json
import urllib.request
from pathlib import Path

from glm_ray.bench import cli, report
from tests.bench.test_report import SGLANG_BLOCK

SHAREGPT = Path(__file__).parent / "data" / "sharegpt_small.json"

TOL = 0.25
INPUT_LEN, OUTPUT_LEN, CONC, N = 16, 8, 2, 4


def test_short_run_against_tiny_app(tiny_server, tmp_path, capsys):
    result = tmp_path / "live.jsonl"
    argv = ["--base-url", tiny_server.base_url, "--model", tiny_server.model,
            "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--range-ratio", "1",
            "--concurrency", str(CONC),
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


def _block(out: str) -> dict[str, str]:
    """The printed sglang block: its lines' labels (checked against sglang's) and label -> value."""
    lines = out.splitlines()
    start = lines.index(SGLANG_BLOCK[0])
    block = lines[start:start + len(SGLANG_BLOCK)]
    assert [ln if ln[:1] in "=-" else ln[:40].rstrip() for ln in block] == SGLANG_BLOCK
    return {ln[:40].rstrip(): ln[41:].strip() for ln in block}


def test_copied_sglang_command_runs_as_written(tiny_server, tmp_path, monkeypatch, capsys):
    """`glm-ray bench --base-url URL --dataset-name random --random-input-len 32 --random-output-len 8
    --num-prompts 8 --max-concurrency 4`: sglang's defaults apply (range ratio 0: lengths uniform in
    [1, 32] and [1, 8], ignore_eos, seed 1), results go to bench-results/ of the working directory."""
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["--base-url", tiny_server.base_url, "--dataset-name", "random", "--random-input-len", "32",
                   "--random-output-len", "8", "--num-prompts", "8", "--max-concurrency", "4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    values = _block(out)
    assert values["Successful requests:"] == "8" and values["Max request concurrency:"] == "4"
    assert values["Traffic request rate:"] == "inf"
    (path,) = (tmp_path / "bench-results").glob("*.jsonl")
    (row,) = report.load_jsonl(path)
    assert row["model"] == tiny_server.model and row["completed"] == 8 and row["failed"] == 0, row["errors"]
    assert row["random_input_len"] == 32 and row["random_output_len"] == 8 and row["random_range_ratio"] == 0.0
    assert row["output_len_matches_request"]                       # ignore_eos: every output is its max_tokens
    assert 8 <= row["total_input_tokens"] <= 8 * 32 and 8 <= row["total_output_tokens"] <= 8 * 8
    assert row["total_input_tokens"] < 8 * 32 and row["total_output_tokens"] < 8 * 8   # lengths vary (r = 0)
    assert int(values["Total input tokens:"]) == row["total_input_tokens"]
    assert int(values["Total generated tokens:"]) == row["total_output_tokens"]
    assert row["peak_concurrent_requests"] <= 4 and row["max_concurrent_requests"] == row["peak_concurrent_requests"]
    assert float(values["Mean TTFT (ms):"]) == round(row["mean_ttft_ms"], 2) > 0


def test_sharegpt_file_through_the_servers_tokenizer(tiny_server, tmp_path, capsys):
    result = tmp_path / "sg.jsonl"
    rc = cli.main(["--base-url", tiny_server.base_url, "--backend", "vllm", "--dataset-name", "sharegpt",
                   "--dataset-path", str(SHAREGPT),
                   "--sharegpt-output-len", "6", "--num-prompts", "4", "--max-concurrency", "2",
                   "--output-file", str(result), "--output-details", "--disable-tqdm", "--no-plot"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert _block(out)["Backend:"] == "vllm"
    (row,) = report.load_jsonl(result)
    assert row["completed"] == 4 and row["dataset_name"] == "sharegpt" and row["output_lens"] == [6] * 4
    # the prompts are fixture human turns as the server's /tokenize counts them (asked here directly)
    counts = set()
    for conv in json.loads(SHAREGPT.read_text()):
        turns = conv.get("conversations", conv.get("conversation"))
        if len(turns) >= 2:
            req = urllib.request.Request(tiny_server.base_url + "/tokenize", method="POST",
                                         data=json.dumps({"prompt": turns[0]["value"]}).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                counts.add(json.loads(resp.read())["count"])
    assert set(row["input_lens"]) <= counts and row["total_input_tokens"] == sum(row["input_lens"])
