"""The periodic engine stats line (engine/stats_log.py) over a real engine's steps: its counts are the
engine's own (prompt tokens scheduled, tokens emitted, decode vs prefill/mixed steps) and its step
medians come from the steps' finish times; nothing is logged before an interval has passed or when
no step ran in it."""
from __future__ import annotations

import logging
import re

from glm_ray import LLM, SamplingParams
from glm_ray.engine.stats_log import StatsLogger


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_stats_line_counts_the_engines_steps(tiny_dir, caplog):
    llm = LLM(tiny_dir, dtype="float32")
    eng = llm.engine
    clock = _Clock()
    log = StatsLogger(eng, interval_s=10.0, clock=clock)
    clock.t = 1.0
    assert log.maybe_log() is None                              # interval not reached
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11, 12] for i in range(3)]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    emitted, firsts = 0, {}
    while eng.has_unfinished():
        deltas = eng.step()
        log.on_step(deltas)
        emitted += sum(len(d.new_token_ids) for d in deltas)
        for d in deltas:                               # the first token's delta carries its time, once
            if d.first_token_time is not None:
                assert d.request_id not in firsts and d.first_token_time >= d.first_scheduled_time >= d.arrival_time
                firsts[d.request_id] = d.first_token_time - d.arrival_time
    assert sorted(firsts) == ["r0", "r1", "r2"]
    steps = list(eng.step_history)
    decode = [s for s in steps[1:] if s.num_decode_seqs == s.num_tokens > 0]
    other = [s for s in steps[1:] if not (s.num_decode_seqs == s.num_tokens > 0)]
    # a 10 s window that holds every step (their finish times are real monotonic stamps)
    log._since = min(s.finished_at for s in steps) - 1e-6
    clock.t = log._since + 10.0
    with caplog.at_level(logging.INFO, logger="glm_ray.engine.stats_log"):
        line = log.maybe_log()
    assert line is not None and line in caplog.text
    assert emitted == 3 * 6
    assert f"prompt {sum(len(p) for p in prompts) / 10:.1f} tok/s" in line
    assert f"generation {emitted / 10:.1f} tok/s" in line
    assert "running 0, waiting 0, KV cache 0.0%" in line
    assert f"{len(decode)} decode steps" in line and "median at batch 3" in line
    if other:
        assert f"{len(other)} prefill/mixed steps" in line
    ttft = re.search(r"TTFT in the engine ([\d.]+) ms median \(queued ([\d.]+) ms\), 3 requests", line)
    assert ttft is not None, line
    assert float(ttft.group(1)) == round(1e3 * sorted(firsts.values())[1], 1)   # the median of three
    assert 0 <= float(ttft.group(2)) <= float(ttft.group(1))
    ms = float(re.search(r"decode steps: ([\d.]+) ms", line).group(1))
    periods = sorted(b.finished_at - a.finished_at for a, b in zip(steps, steps[1:])
                     if b.num_decode_seqs == b.num_tokens > 0)
    assert min(periods) * 1e3 - 0.05 <= ms <= max(periods) * 1e3 + 0.05
    # the next window: no step ran, nothing logged; a zero interval never logs
    clock.t += 10.0
    assert log.maybe_log() is None
    assert StatsLogger(eng, interval_s=0.0, clock=clock).maybe_log() is None


def test_itl_in_the_engine_from_emission_times(tiny_dir):
    """The line's "ITL in the engine": gaps between a request's consecutive emitted tokens (a delta of n tokens
    splits its gap evenly), first tokens and finished requests excluded, the window's tokens only."""
    from glm_ray.engine.outputs import TokenDelta
    eng = LLM(tiny_dir, dtype="float32").engine
    eng.add_request("a", [5, 6, 7], SamplingParams(max_tokens=8))   # live in the engine: its entry outlives a window
    clock = _Clock()
    log = StatsLogger(eng, interval_s=10.0, clock=clock)

    def emit(t, *deltas):
        clock.t = t
        log.on_step(list(deltas))

    emit(0.000, TokenDelta("a", [1], first_token_time=0.0))
    emit(0.010, TokenDelta("a", [2]))
    emit(0.020, TokenDelta("b", [1], first_token_time=0.02))
    emit(0.030, TokenDelta("a", [3, 4]))                       # 20 ms over two tokens: 10 each
    emit(0.050, TokenDelta("b", [2], finished=True))          # 30 ms
    gaps_ms = [10.0, 10.0, 10.0, 30.0]                         # per token, by hand
    line = log.line([], 10.0)
    want = f"ITL in the engine {sum(gaps_ms) / len(gaps_ms):.1f} ms mean ({sorted(gaps_ms)[1]:.1f} median), 4 tokens"
    assert want in line, line
    emit(0.060, TokenDelta("b", [9], first_token_time=0.06))  # "b" finished: a new first token, no gap
    assert "4 tokens" in log.line([], 10.0)
    clock.t = 10.0
    log.maybe_log()                                            # a new window: its gaps only
    emit(10.5, TokenDelta("a", [5]))
    assert f"ITL in the engine {1e3 * (10.5 - 0.030):.1f} ms mean" in log.line([], 10.0)
