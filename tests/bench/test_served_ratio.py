"""scripts/served_ratio.py: the engine's ITL per bench concurrency from the served log's stats lines (each window
to the smallest C at or above its running count, token-weighted), and the printed split of the ratio."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "served_ratio", Path(__file__).resolve().parents[2] / "scripts" / "served_ratio.py")
sr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sr)


def _stats(running: int, itl: float, tokens: int) -> str:
    """One stats line as engine/stats_log.py writes it (the parts the script reads), behind Ray's actor prefix."""
    return (f"(EngineHost pid=1) INFO:glm_ray.engine.stats_log:engine: prompt 10.0 tok/s, generation 5.0 tok/s | "
            f"running {running}, waiting 0, KV cache 1.0%, prefix cache hits 0.0% | 9 decode steps: 5.0 ms median "
            f"at batch {running} | ITL in the engine {itl} ms mean ({itl} median), {tokens} tokens\n")


def test_windows_go_to_the_smallest_concurrency_at_or_above_running(tmp_path):
    log = tmp_path / "serve.log"
    log.write_text("".join([
        _stats(1, 5.0, 100),
        "unrelated line\n",
        _stats(16, 11.0, 100),          # a window mostly of the C=16 wave's start
        _stats(13, 14.0, 300),          # between waves the snapshot reads < 16: still C=16
        _stats(64, 20.0, 1000),
        _stats(45, 24.0, 1000),
        _stats(0, 99.0, 0),             # an idle window: no tokens, ignored
    ]))
    eng = sr.engine_itl_by_concurrency(str(log), [1, 16, 64])
    assert eng[1] == pytest.approx(5.0)
    assert eng[16] == pytest.approx((11.0 * 100 + 14.0 * 300) / 400)
    assert eng[64] == pytest.approx(22.0)


def test_main_prints_both_factors(tmp_path, capsys):
    served, offline, log = tmp_path / "s.jsonl", tmp_path / "o.jsonl", tmp_path / "serve.log"
    served.write_text(json.dumps({"max_concurrency": 16, "mean_itl_ms": 13.2, "median_itl_ms": 12.0}) + "\n")
    offline.write_text(json.dumps({"batch": 16, "decode_step_ms": 12.0}) + "\n")
    log.write_text(_stats(16, 13.0, 500))
    sr.main(str(served), str(offline), str(log))
    out = capsys.readouterr().out
    assert "ratio mean 1.100" in out and "served / engine 1.015" in out and "engine / offline step 1.083" in out


def test_a_drain_window_stays_with_the_concurrency_that_ran_it(tmp_path):
    """After the last C=64 wave the snapshot reads `running 1`, but its decode median ran at batch 64 and the bench
    ran C=1 first: the window is C=64's, not C=1's (session 36's H100 run gave C=1 an engine ITL of 18 ms so)."""
    log = tmp_path / "serve.log"
    log.write_text("".join([
        _stats(1, 5.0, 500),
        _stats(16, 12.0, 500),
        _stats(64, 20.0, 1000),
        _stats(1, 18.0, 1000).replace("at batch 1 ", "at batch 64 "),
        _stats(1, 30.0, 10),           # a lone straggler later still: not C=1's either
    ]))
    eng = sr.engine_itl_by_concurrency(str(log), [1, 16, 64])
    assert eng[1] == pytest.approx(5.0)
    assert eng[16] == pytest.approx(12.0)
    assert eng[64] == pytest.approx((20.0 * 1000 + 18.0 * 1000 + 30.0 * 10) / 2010)
