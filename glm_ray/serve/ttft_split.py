"""Where a request's time to first token goes on its way through the app: the ingress's periodic split line.

Each process measures only its own clock (the ingress, the Router and the engine may run on different
hosts), and the first token's delta carries the inner parts out (`TokenDelta.ttft_parts`, seconds): the
engine's arrival -> first token (and its queued part), set from the engine's own timestamps, and the
Router's generate() entry -> first delta there. The ingress adds its own and logs, every
`GLM_RAY_LOG_STATS_INTERVAL_S` seconds with traffic, the medians of

    ingress: TTFT split over 32 requests (median ms): in the ingress before the Router call 1.2 | ingress <->
    Router hops 3.4 | Router <-> engine hops 20.1 (add 12.0, out 8.0) | in the engine 125.3 (queued 0.2) |
    total at the ingress 150.0

    before   the ingress handler's start -> the Router call (parse, tokenize, sampling parameters); its
             "body" part: -> the request body fully read (Serve's proxy hands the body over to the replica)
    ingress  ingress <-> Router: Serve's routing of the call + the first item's way back
    router   Router <-> engine: the add reaching the engine's loop + the step's output reaching the Router;
             when the engine runs on the Router's host (one monotonic clock) the two legs apart: "add" (the
             Router's generate() entry -> the add reaching the engine's process) and "out" (the first token
             -> the Router holding its step output)
    engine   the engine's arrival (its add in the engine's process) -> first token (queued: -> first
             scheduled, incl. the wait for the loop's next scheduling point)
    total    the ingress handler's start -> the first delta at the ingress (= the sum of the four)

plus the ingress's event-loop lag over the window (`LoopLag`: how late a 20 ms timer fires, p50 / max): a busy
loop delays every hop through it by about that much. The Router logs its own loop lag on the same interval
("router: event-loop lag ..."), where the engine's step outputs are fanned out to the streams.

A client's TTFT minus `total` is the HTTP side (Serve's proxy, the network, the client). This is how an
operator tells a slow prefill (engine) from a slow path around it; the engine's own stats line
(engine/stats_log.py) gives the steps behind the engine part.
"""
from __future__ import annotations

import asyncio
import logging
import statistics
import time
from dataclasses import dataclass

# Serve's replica logger: its handlers reach the replica's log file and the driver's stderr, where a
# glm_ray.* logger's INFO lines in a Serve replica would not (the root logger there stays at WARNING)
logger = logging.getLogger("ray.serve")

PARTS = ("before", "ingress", "router", "engine", "queued", "total")


@dataclass
class Arrival:
    """An HTTP request's times at the ingress (monotonic seconds): the handler's start and, once read, its body."""
    received: float
    body_read: float | None = None


def split(t_received: float, t_call: float, t_first: float, inner: dict[str, float] | None,
          body_read: float | None = None) -> dict[str, float]:
    """One request's parts (seconds) from the ingress's monotonic times (handler start, Router call, first delta;
    `body_read`: the body fully read, if known) and the inner parts the first delta carried ({"router": s,
    "engine": s, "queued": s}, each optional)."""
    inner = inner or {}
    total, at_router = t_first - t_received, t_first - t_call
    router_s = min(inner.get("router", 0.0), at_router)        # no Router part: all of it is the hop
    engine_s = min(inner.get("engine", 0.0), router_s)
    parts = {"before": t_call - t_received, "ingress": max(at_router - router_s, 0.0),
             "router": max(router_s - engine_s, 0.0), "engine": engine_s, "queued": inner.get("queued", 0.0),
             "total": total}
    if "add" in inner and "out" in inner:
        parts["add"], parts["out"] = inner["add"], inner["out"]
    if body_read is not None:
        parts["body"] = min(max(body_read - t_received, 0.0), parts["before"])
    return parts


class LoopLag:
    """How late a `period_s` timer fires on the running event loop (seconds), collected until `take()`.
    `start()` from inside the loop; the probe costs one wake-up per period."""

    def __init__(self, period_s: float = 0.02):
        self.period_s = period_s
        self.samples: list[float] = []
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._probe())

    async def _probe(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(self.period_s)
            self.samples.append(max(time.monotonic() - t - self.period_s, 0.0))
            del self.samples[:-4096]                                   # bounded between takes

    def take(self) -> str:
        """'p50 X / max Y ms' of the samples since the last take (and forget them); '-' when none."""
        xs, self.samples = sorted(self.samples), []
        return f"p50 {1e3 * xs[len(xs) // 2]:.1f} / max {1e3 * xs[-1]:.1f} ms" if xs else "-"


class TTFTSplit:
    """Collects the parts per first token (`add`) and logs the medians line at most once per interval;
    `start()` (from inside the loop) also logs a window that traffic left pending: without it the last
    window before a quiet period would wait for the next request."""

    def __init__(self, interval_s: float, clock=time.monotonic, lag: LoopLag | None = None):
        self.interval_s, self.clock, self.lag = interval_s, clock, lag
        self._since = clock()
        self._rows: list[dict[str, float]] = []
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None and self.interval_s > 0:
            self._task = asyncio.get_running_loop().create_task(self._flusher())

    async def _flusher(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.flush()

    def add(self, parts: dict[str, float]) -> str | None:
        """Record one request's parts; returns (and logs) the line when the interval is over."""
        if self.interval_s <= 0:
            return None
        self._rows.append(parts)
        return self.flush()

    def flush(self) -> str | None:
        """Log (and return) the pending window's line if it has rows and its interval is over."""
        now = self.clock()
        if not self._rows or now - self._since < self.interval_s:
            return None
        line = self.line(self._rows)
        if self.lag is not None:
            line += f" | event-loop lag {self.lag.take()}"
        logger.info("%s", line)
        self._since, self._rows = now, []
        return line

    @staticmethod
    def line(rows: list[dict[str, float]]) -> str:
        med = {k: 1e3 * statistics.median(r[k] for r in rows) for k in PARTS}
        legs = [r for r in rows if "add" in r]
        bodies = [r["body"] for r in rows if "body" in r]
        before = f"{med['before']:.1f}" + (f" (body {1e3 * statistics.median(bodies):.1f})" if bodies else "")
        router = f"{med['router']:.1f}"
        if legs:
            router += (f" (add {1e3 * statistics.median(r['add'] for r in legs):.1f}, "
                       f"out {1e3 * statistics.median(r['out'] for r in legs):.1f})")
        return (f"ingress: TTFT split over {len(rows)} requests (median ms): in the ingress before the Router "
                f"call {before} | ingress <-> Router hops {med['ingress']:.1f} | Router <-> engine "
                f"hops {router} | in the engine {med['engine']:.1f} (queued {med['queued']:.1f}) | "
                f"total at the ingress {med['total']:.1f}")
