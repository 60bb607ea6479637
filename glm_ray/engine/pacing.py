"""When the served loop schedules its next step under async scheduling (`GLM_RAY_LATE_SCHEDULING`).

The overlapped loop schedules and launches step N+1 while step N runs on the device. Done at once (vLLM's
async scheduling and sglang's overlap loop do), that schedule point sits at the start of step N, so a
request that arrives during step N misses N+1 and waits for N+2: one whole step of extra time to its first
token (a mixed step on glm5-flash-31b is ~40 ms). `StepPacer` moves the schedule point to the latest moment
that still has N+1 queued before N ends — N's start on the device + N's expected device time - the host's
time to schedule and launch - a margin — and the served loop (`serve/engine_host.py`) waits until then or
until a request arrives, whichever comes first: a request arriving during step N then joins N+1.

Expected device time: the minimum of the last few measured device times (`StepTimeline`'s CUDA events) of
steps of the same shape class (decode-only by batch, otherwise by token count, in power-of-two buckets);
the host's time: the maximum of the last few schedule + launch times of steps of the class the next step will
likely be (`next_step_key`: a decode of the running requests unless a prompt waits or is mid-prefill; an
eager mixed step's launch takes several times a graph replay's, so one pooled maximum would leave a decode
step's schedule point almost where it was); the margin: 0.5 ms + the longest idle
gap (at most 5 ms) the device had before any of the last 64 steps queued behind a running one (a late
wake-up, e.g. the loop's thread waiting for the GIL, shows there and moves later schedule points earlier).
Minimum and maximum err early: a wrong guess costs the waiting request a step, as before, not the running
ones an idle device. With no history for a shape class the loop schedules at once, as without pacing.
"""
from __future__ import annotations

from collections import deque

from glm_ray.engine.contract import SchedulerOutput

ShapeKey = tuple[str, int]


def shape_key(sched: SchedulerOutput) -> ShapeKey:
    """The step's shape class: ("decode", batch bucket) when every row decodes one token, else ("mixed",
    token-count bucket); buckets are the next power of two."""
    seqs = sched.seqs
    if seqs and all(len(s.token_ids) == 1 and s.sample for s in seqs):
        return "decode", _bucket(len(seqs))
    return "mixed", _bucket(sched.num_tokens)


def _bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def host_key(key: ShapeKey) -> ShapeKey:
    """The class a step's host time is kept under: decode steps by batch bucket, every mixed step in one."""
    return ("mixed", 0) if key[0] == "mixed" else key


def next_step_key(scheduler) -> ShapeKey:
    """The host-time class of the step the scheduler would build next if nothing arrived: a decode of the
    running requests, or a mixed step while a prompt waits or a running request has prompt tokens left."""
    if scheduler.waiting or any(r.num_tokens + r.num_inflight - r.num_computed_tokens > 1 for r in scheduler.running):
        return "mixed", 0
    return "decode", _bucket(len(scheduler.running))


class StepPacer:
    """Expected device time per shape class and the host's launch time, from the steps the loop ran."""

    def __init__(self, margin_s: float = 0.5e-3, history: int = 8):
        self.margin_s = margin_s
        self.history = history
        self._device: dict[ShapeKey, deque[float]] = {}
        self._host: dict[ShapeKey, deque[float]] = {}
        self._gaps: deque[float] = deque(maxlen=8 * history)
        self.paced = 0              # schedule points the loop waited for
        self.joined = 0             # ... of them cut short by an arriving request
        self.waited_s = 0.0         # time spent waiting for them
        self.active = True          # off: the loop schedules at once (still learning the times)
        self.alternate = False      # measurement: `active` flips at every stats window (engine/stats_log.py)

    def observe_device(self, key: ShapeKey, device_s: float | None, gap_s: float | None = None) -> None:
        """A finished step's device time and the device's idle gap before it (None: not measured)."""
        if device_s is not None and device_s > 0:
            self._device.setdefault(key, deque(maxlen=self.history)).append(device_s)
        if gap_s is not None:
            self._gaps.append(min(gap_s, 5e-3))          # one stall (a GC pause) must not switch pacing off

    def observe_host(self, key: ShapeKey, seconds: float) -> None:
        """The host's time from the schedule point to the launch (admission, schedule, launch) of a step of
        shape `key`."""
        self._host.setdefault(host_key(key), deque(maxlen=2 * self.history)).append(seconds)

    def deadline(self, started_at: float | None, key: ShapeKey | None, next_key: ShapeKey) -> float | None:
        """The latest time (the `started_at` clock) at which scheduling the next step (likely of class
        `next_key`) still queues it before the running step of shape `key`, started on the device at
        `started_at`, ends; None: schedule now."""
        if started_at is None or key is None:
            return None
        dev = self._device.get(key)
        host = self._host.get(host_key(next_key)) or [t for d in self._host.values() for t in d]
        if not dev or not host:
            return None
        return started_at + min(dev) - max(host) - self.margin_s - max(self._gaps, default=0.0)

    def stats(self) -> dict:
        return {"paced": self.paced, "joined": self.joined, "waited_s": self.waited_s,
                "host_ms": {f"{k[0]}:{k[1]}": max(d) * 1e3 for k, d in self._host.items()}}
