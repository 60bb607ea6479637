"""`python -m glm_ray.bench.shared_prefix` on CPU with the tiny model: one engine runs the shared-prefix
workload with the cache on and off; the greedy outputs agree, and at concurrency 1 the hit rate is the
workload's ideal (every group's first prompt misses, every later one finds the whole-block prefix)."""
from __future__ import annotations

import json

import pytest

from glm_ray.bench import shared_prefix

G, P, S, Q, OUT = 3, 4, 64, 8, 4          # groups, prompts per group, prefix (4 blocks of 16), question, output


def test_cache_on_and_off_in_one_engine(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    assert shared_prefix.main(["--dtype", "float32", "--device", "cpu", "--gsp-num-groups", str(G),
                               "--gsp-prompts-per-group", str(P), "--gsp-system-prompt-len", str(S),
                               "--gsp-question-len", str(Q), "--gsp-output-len", str(OUT), "--concurrency", "1",
                               "--modes", "on", "off", "--repeats", "2", "--warmup-groups", "1",
                               "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["mode"] for r in rows] == ["on", "off", "off", "on"]            # alternating rounds
    ideal = G * (P - 1) * S / (G * P * (S + Q))
    for r in rows:
        assert r["requests"] == G * P
        assert r["hit_rate"] == (pytest.approx(ideal) if r["mode"] == "on" else 0.0)
        assert r["steps_to_first"] >= 1 and r["mean_ttft_ms"] > 0 and r["output_tok_s"] > 0
        assert r["decode_steps"] + r["mixed_steps"] > 0
        # at C=1 every group's first prompt misses and every later one hits (cache on); off: all miss
        assert r["hit_requests"] == (G * (P - 1) if r["mode"] == "on" else 0)
    text = capsys.readouterr().out
    assert f"greedy outputs identical, on vs off: {G * P} / {G * P} prompts" in text
    assert "C=1: mean_ttft_off_over_on" in text


def test_outputs_are_compared_per_prompt_and_copies_of_a_new_prefix_are_the_ab():
    """All six prompts at once (C=6): with in-flight prefix sharing each group's prefix is computed once and
    its other two prompts take it from the cache; `on-copies` computes it per prompt (nothing cached yet
    when all six are admitted), as before that policy. Outputs of both == the cache off's."""
    rows, same = shared_prefix.run(None, modes=("on", "on-copies", "on-lpm", "off"), concurrency=(6,), num_groups=2,
                                   prompts_per_group=3, system_prompt_len=32, question_len=5, output_len=3,
                                   warmup_groups=0, dtype="float32", device="cpu")
    assert same == {m: {"rows": 6, "identical": 6} for m in ("on", "on-copies", "on-lpm")}
    by = {r["mode"]: r for r in rows}
    assert by["on"]["hit_rate"] == pytest.approx(4 * 32 / (6 * 37)) and by["on"]["hit_requests"] == 4
    assert by["on-copies"]["hit_rate"] == 0.0 == by["off"]["hit_rate"]


def test_absorbed_tails_ab_in_one_engine(tmp_path, capsys):
    """--absorb 0 16: every mode under each absorbed-tail threshold in turn on one engine (the runner's
    setting switched between runs), ratios per threshold; the cache hits are the same under both."""
    out = tmp_path / "rows.jsonl"
    assert shared_prefix.main(["--dtype", "float32", "--device", "cpu", "--gsp-num-groups", "2",
                               "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "32",
                               "--gsp-question-len", "8", "--gsp-output-len", "3", "--concurrency", "1",
                               "--absorb", "0", "16", "--warmup-groups", "0", "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["mode"], r["absorb"]) for r in rows] == [("on", 0), ("on", 16), ("off", 0), ("off", 16)]
    assert rows[0]["hit_rate"] == rows[1]["hit_rate"] > 0
    text = capsys.readouterr().out
    assert "C=1 absorb=0: mean_ttft_off_over_on" in text and "C=1 absorb=16: mean_ttft_off_over_on" in text
