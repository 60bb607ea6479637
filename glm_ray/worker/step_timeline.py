"""Where a step's time goes on the device's clock (measurement only: `GLM_RAY_STEP_TIMELINE=1`).

Rank 0's runner marks the start of each step's device work (before its input copies or graph replay) and
its end (after the sampled tokens' copy to the host). On a GPU the marks are CUDA events on the step's
stream, read after the step's one host wait, so they add no synchronization: `device` is the time from
the first to the last of the step's device work, `gap` the time the device sat idle between the end of
the previous step and this one's start (0 when the host had already queued this step, as an overlapped
loop should). On the CPU the device is the host: the marks are wall-clock times, and `gap` is the host's
scheduling, bookkeeping and staging between two steps' compute.
"""
from __future__ import annotations

import time

import torch


class StepTimeline:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._prev_end = None

    def mark(self):
        """A point on the device's timeline (a recorded CUDA event, or the host's clock on the CPU)."""
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _seconds(self, a, b) -> float:
        return (a.elapsed_time(b) / 1e3) if self.cuda else (b - a)

    def timings(self, start, end) -> dict[str, float]:
        """{"device": s, "gap": s} of a step whose end mark has completed (steps are read in launch order);
        no "gap" for the first step read."""
        if self.cuda:
            end.synchronize()       # done already for a step that sampled (its one host wait came first)
        t = {"device": self._seconds(start, end)}
        if self._prev_end is not None:
            t["gap"] = max(0.0, self._seconds(self._prev_end, start))
        self._prev_end = end
        return t
