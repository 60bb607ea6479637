"""The periodic engine stats line in the log (vLLM's `Avg prompt throughput: ... tokens/s` line).

Every `GLM_RAY_LOG_STATS_INTERVAL_S` seconds (10; 0 = off) the loop that drives an `EngineCore` — the
Router's in-process loop or rank 0's `EngineHost` — logs one line about the steps finished since the
last one:

    engine: prompt 4096.0 tok/s, generation 1830.2 tok/s | running 64, waiting 0, KV cache 12.3%,
    prefix cache hits 88.2% | 480 decode steps: 20.1 ms median at batch 64; 20 prefill/mixed steps:
    245.3 ms median, 2048 tokens | TTFT in the engine 61.0 ms median (queued 3.2 ms), 16 requests |
    ITL in the engine 24.9 ms mean (20.1 median), 28672 tokens | device 18.2 ms, gap 0.10 ms (mean 0.12)

A step's time here is the wall time between two consecutive finished steps (what a streaming client's
inter-token latency sees; under async scheduling the two overlap, so the sum of schedule / execute /
update is not it). "decode" steps are those where every scheduled token is one sequence's next token
(the CUDA-graph steps); every other step admits prompt tokens ("prefill/mixed", eager). `device` and
`gap` appear when the step timeline is on (GLM_RAY_STEP_TIMELINE, or late scheduling on a GPU, whose
line also counts the loop's waits for a later schedule point and those an arriving request ended). "TTFT in the engine" covers the
requests whose first token came in the window: from their arrival at the engine to that token (queued:
to their first scheduling). "ITL in the engine" is the time between a request's consecutive tokens as the
loop emits them (a step's emission time = when the loop finished it; a delta of n tokens splits its gap evenly, as
the bench's sglang-native ITL does), over the tokens after each request's first emitted in the window: decode
steps plus every prefill/mixed step that ran between them. So served ITL / this = what the path after the engine
adds (issue #19's served-vs-engine ratio), and this / the decode step median = what interleaved prefills add.
It is how an operator tells a slow decode step from a slow consumer, and a
slow prefill from a slow path before the engine: served ITL or TTFT far above the medians here means the
time is spent outside the engine (the ingress, the Router, Serve's streaming, the client).
"""
from __future__ import annotations

import logging
import statistics
import time

from glm_ray.engine.engine_core import EngineCore, StepStats
from glm_ray.engine.outputs import TokenDelta

logger = logging.getLogger(__name__)


class StatsLogger:
    """Counts the tokens a loop emits (`on_step`) and logs the stats line at most once per interval
    (`maybe_log`, called once per loop iteration: one clock read when nothing is due)."""

    def __init__(self, engine: EngineCore, interval_s: float, clock=time.monotonic):
        self.engine, self.interval_s, self.clock = engine, interval_s, clock
        self._since = clock()
        self._generated = 0
        self._ttft: list[tuple[float, float]] = []     # (first token - arrival, first scheduled - arrival) s
        self._last_emit: dict[str, float] = {}          # request id -> when the loop emitted its last token
        self._itl: list[float] = []                     # the window's per-token gaps (s)
        self._prefix = (engine.kv.prefix_queries, engine.kv.prefix_hits)
        self.pacer = None                               # the served loop's StepPacer (late scheduling), if on
        self._paced = (0, 0, 0.0)

    def on_step(self, deltas: list[TokenDelta]) -> None:
        self._generated += sum(len(d.new_token_ids) for d in deltas)
        now = self.clock() if deltas else 0.0
        for d in deltas:
            if d.first_token_time is not None:
                sched = d.first_scheduled_time if d.first_scheduled_time is not None else d.first_token_time
                self._ttft.append((d.first_token_time - d.arrival_time, sched - d.arrival_time))
            n = len(d.new_token_ids)
            if n:
                last = self._last_emit.get(d.request_id)
                if last is not None and d.first_token_time is None:
                    self._itl.extend([(now - last) / n] * n)
                self._last_emit[d.request_id] = now
            if d.finished:
                self._last_emit.pop(d.request_id, None)

    def maybe_log(self) -> str | None:
        """Log (and return) the line when an interval has passed and a step ran since the last one."""
        if self.interval_s <= 0:
            return None
        now = self.clock()
        if now - self._since < self.interval_s:
            return None
        steps = [s for s in self.engine.step_history if s.finished_at > self._since]
        line = self.line(steps, now - self._since) if steps else None
        if line:
            logger.info("%s", line)
        self._since, self._generated, self._ttft, self._itl = now, 0, [], []
        # an aborted request ends without a finished delta: keep only the engine's live requests
        self._last_emit = {r: t for r, t in self._last_emit.items() if r in self.engine.requests}
        self._prefix = (self.engine.kv.prefix_queries, self.engine.kv.prefix_hits)
        if self.pacer is not None:
            self._paced = (self.pacer.paced, self.pacer.joined, self.pacer.waited_s)
            if self.pacer.alternate:                    # the in-lifetime A/B: the next window the other way
                self.pacer.active = not self.pacer.active
        return line

    def line(self, steps: list[StepStats], window_s: float) -> str:
        e = self.engine
        q, h = e.kv.prefix_queries - self._prefix[0], e.kv.prefix_hits - self._prefix[1]
        prompt = sum(s.num_prefill_tokens for s in steps)
        parts = [f"engine: prompt {prompt / window_s:.1f} tok/s, generation {self._generated / window_s:.1f} tok/s",
                 f"running {len(e.scheduler.running)}, waiting {len(e.scheduler.waiting)}, "
                 f"KV cache {100 * e.kv.usage():.1f}%"
                 + (f", prefix cache hits {100 * h / q:.1f}%" if q else "")]
        decode, other = _periods(steps)
        kinds = []
        if decode:
            kinds.append(f"{len(decode)} decode steps: {_ms(decode)} median at batch "
                         f"{statistics.median(s.num_decode_seqs for s, _ in decode):.0f}")
        if other:
            kinds.append(f"{len(other)} prefill/mixed steps: {_ms(other)} median, "
                         f"{statistics.median(s.num_tokens for s, _ in other):.0f} tokens")
        if kinds:
            parts.append("; ".join(kinds))
        if self._ttft:
            parts.append(f"TTFT in the engine {1e3 * statistics.median(t for t, _ in self._ttft):.1f} ms median "
                         f"(queued {1e3 * statistics.median(q for _, q in self._ttft):.1f} ms), "
                         f"{len(self._ttft)} request{'s' if len(self._ttft) != 1 else ''}")
        if self._itl:
            parts.append(f"ITL in the engine {1e3 * statistics.fmean(self._itl):.1f} ms mean "
                         f"({1e3 * statistics.median(self._itl):.1f} median), {len(self._itl)} tokens")
        dev = [s.worker_timings["device"] for s in steps if "device" in s.worker_timings]
        if dev:
            gap = [s.worker_timings["gap"] for s in steps if "gap" in s.worker_timings]
            parts.append(f"device {1e3 * statistics.median(dev):.1f} ms"
                         + (f", gap {1e3 * statistics.median(gap):.2f} ms (mean {1e3 * statistics.fmean(gap):.2f})"
                            if gap else ""))
        if self.pacer is not None:
            waits = self.pacer.paced - self._paced[0]
            mean = 1e3 * (self.pacer.waited_s - self._paced[2]) / waits if waits else 0.0
            state = ("on" if self.pacer.active else "off") if self.pacer.alternate else ""
            parts.append(f"late scheduling{' ' + state if state else ''}: {waits} waits of {mean:.1f} ms mean, "
                         f"{self.pacer.joined - self._paced[1]} ended by an arrival")
        return " | ".join(parts)


def _periods(steps: list[StepStats]) -> tuple[list, list]:
    """(step, seconds since the previous step finished) of each step after the first, split into decode
    steps and prefill/mixed steps."""
    decode, other = [], []
    for prev, s in zip(steps, steps[1:]):
        item = (s, s.finished_at - prev.finished_at)
        (decode if s.num_decode_seqs == s.num_tokens > 0 else other).append(item)
    return decode, other


def _ms(items: list) -> str:
    return f"{1e3 * statistics.median(p for _, p in items):.1f} ms"
