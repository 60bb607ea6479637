"""The running/waiting/KV gauges follow the engine at once: when aborts (clients that went away) empty a
busy engine, both engine loops (`EngineHost._loop` beside rank 0, `LocalEngine.run` in the Router)
publish a `StepBatch` with the new gauges right away instead of on the next idle tick (4 s), and
`Router._on_step` hands it to `EngineMetrics.on_step`. Without Ray or a model: a fake engine whose
requests never finish, so only the aborts can empty it."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from types import SimpleNamespace

from glm_ray.engine.engine_core import StepStats
from glm_ray.engine.stats_log import StatsLogger
from glm_ray.serve import engine_host
from glm_ray.serve.engine_client import LocalEngine
from glm_ray.serve.engine_host import Admission, EngineHost, StepBatch

#: far below the idle tick (engine_host._IDLE_TICK_S = 4 s) the old code waited for
PROMPT_S = 1.0


class _Engine:
    """Requests run until aborted; each step takes a few ms and emits nothing."""

    def __init__(self):
        self.scheduler = SimpleNamespace(running=[], waiting=[])
        self.kv = SimpleNamespace(usage=lambda: 0.1 * len(self.scheduler.running), prefix_queries=0, prefix_hits=0)
        self.last_stats = SimpleNamespace(num_prefill_tokens=0, num_decode_seqs=0, num_preempted=0)
        self.executor = SimpleNamespace(shutdown=lambda: None)
        self.step_history: deque = deque(maxlen=2048)

    def add_request(self, rid, ids, params, max_tokens=None, arrival_time=None):
        self.scheduler.running.append(rid)

    def abort(self, rid) -> bool:
        if rid in self.scheduler.running:
            self.scheduler.running.remove(rid)
            return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def step(self):
        time.sleep(0.005)
        n = len(self.scheduler.running)
        self.step_history.append(StepStats(num_tokens=n, num_decode_seqs=n, finished_at=time.monotonic()))
        return []


def _until(batches, pred, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = batches()
        if b is not None and pred(b):
            return b
    return None


def test_engine_host_publishes_the_gauges_when_aborts_empty_the_engine():
    assert engine_host._IDLE_TICK_S > PROMPT_S * 2
    h = EngineHost.__new__(EngineHost)                    # no rank, no model: the loop and its queues
    h.engine, h.admission, h._wake, h._out = _Engine(), Admission(), threading.Event(), queue.Queue()
    h._dead, h._step_started = None, None
    h.stats_log = StatsLogger(h.engine, interval_s=0.0)  # off
    t = threading.Thread(target=h._loop, daemon=True)
    t.start()
    try:
        for rid in ("a", "b", "c"):
            h.add(rid, [1, 2], None, 4)

        def next_batch():
            try:
                return h._out.get(timeout=0.05)
            except queue.Empty:
                return None

        busy = _until(next_batch, lambda b: b.running == 3, timeout=5)
        assert busy is not None and busy.gauges == (3, 0, 0.1 * 3)
        for rid in ("a", "b", "c"):
            h.abort(rid)
        t0 = time.monotonic()
        idle = _until(next_batch, lambda b: b.running == 0, timeout=engine_host._IDLE_TICK_S + 2)
        assert idle is not None, "no StepBatch with the emptied engine's gauges"
        assert time.monotonic() - t0 < PROMPT_S, f"published {time.monotonic() - t0:.1f}s after the aborts"
        assert idle.gauges == (0, 0, 0.0)
        assert _until(next_batch, lambda b: True, timeout=0.5) is None, "an idle engine publishes only on the tick"
    finally:
        h.stop()
        t.join(10)


def test_local_engine_publishes_the_gauges_when_aborts_empty_the_engine():
    from concurrent.futures import ThreadPoolExecutor

    le = LocalEngine.__new__(LocalEngine)                  # no Ray workers: the loop and its admission
    le.engine, le.admission, le._last_ok = _Engine(), Admission(), time.monotonic()
    le._thread = ThreadPoolExecutor(max_workers=1)
    le.stats_log = StatsLogger(le.engine, interval_s=0.0)  # off
    seen: list[tuple[float, StepBatch]] = []

    async def scenario():
        le._wakeup = asyncio.Event()
        task = asyncio.ensure_future(le.run(lambda b: seen.append((time.monotonic(), b))))
        for rid in ("a", "b"):
            le.add(rid, [1], None, 4)
        deadline = time.monotonic() + 10
        while not any(b.running == 2 for _, b in seen):
            assert not task.done(), f"the engine loop ended: {task.exception() if not task.cancelled() else 'cancelled'}"
            assert time.monotonic() < deadline, f"no StepBatch with both requests running: {seen}"
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        for rid in ("a", "b"):
            le.abort(rid)
        while not any(b.running == 0 and t >= t0 for t, b in seen) and time.monotonic() - t0 < 6:
            await asyncio.sleep(0.01)
        task.cancel()
        return t0

    t0 = asyncio.run(scenario())
    le._thread.shutdown()
    emptied = [(t - t0, b.gauges) for t, b in seen if t >= t0 and b.running == 0]   # (a step in flight may land first)
    assert emptied and emptied[0][1] == (0, 0, 0.0), seen
    assert emptied[0][0] < PROMPT_S, f"published {emptied[0][0]:.1f}s after the aborts"


def test_the_router_sets_the_gauges_from_each_step_batch():
    """`Router._on_step` -> `EngineMetrics.on_step` -> the gauge, the same call (no delay of its own)."""
    from glm_ray.serve.router import Router

    class _Metrics:
        def __init__(self):
            self.steps = []

        def on_step(self, *a):
            self.steps.append(a)

        def on_tokens(self, itl):
            pass

    r = Router.__new__(Router)
    r.metrics, r._streams = _Metrics(), {}
    r._on_step(StepBatch(running=0, waiting=0, kv_usage=0.0))
    r._on_step(StepBatch(running=5, waiting=2, kv_usage=0.5, num_decode_seqs=5, prefix_queries=64, prefix_hits=32))
    assert r.metrics.steps == [(0, 0, 0.0, 0, 0, 0, 0, 0), (5, 2, 0.5, 0, 5, 0, 64, 32)]


def test_engine_host_logs_the_last_busy_window_once_idle(caplog):
    """A burst shorter than the stats interval followed by silence still gets its stats line: the idle
    loop calls the logger on its ticks (not only after steps)."""
    h = EngineHost.__new__(EngineHost)
    h.engine, h.admission, h._wake, h._out = _Engine(), Admission(), threading.Event(), queue.Queue()
    h._dead, h._step_started = None, None
    h.stats_log = StatsLogger(h.engine, interval_s=0.5)
    with caplog.at_level(logging.INFO, logger="glm_ray.engine.stats_log"):
        t = threading.Thread(target=h._loop, daemon=True)
        t.start()
        try:
            h.add("a", [1, 2], None, 4)
            time.sleep(0.2)                                   # a short burst of steps, then the engine empties
            h.abort("a")
            deadline = time.monotonic() + engine_host._IDLE_TICK_S + 3
            while "decode steps" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            h.stop()
            t.join(10)
    assert "decode steps" in caplog.text and "running 0" in caplog.text, caplog.text
