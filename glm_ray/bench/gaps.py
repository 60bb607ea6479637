"""Where the GPU idles inside profiled steps: the gaps between consecutive kernels, grouped by what the
host was doing at the time.

A step's `gpu_gaps` (bench.decode's timeline) says how long the GPU sat idle between the step's kernels;
this module says why. For each gap of at least `min_us` it takes the innermost host event running at the
gap's midpoint (a CUDA runtime call such as cudaStreamSynchronize or cudaGraphLaunch, an aten op, or the
bench's own step range when the host was in plain Python) and the kernel that ended the gap, and sums the
gaps per (host event, next kernel). A host sync shows up as a synchronize / DtoH copy / `aten::item` row;
a host-bound stretch (the GPU waiting for launches) as aten ops or Python; a graph's own launch latency as
cudaGraphLaunch.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from torch.autograd import DeviceType


@dataclass(frozen=True)
class GapGroup:
    host: str            # innermost host event at the gaps' midpoints
    next_kernel: str     # the kernel that ended them (name cut to 60 characters)
    count: float         # gaps per step
    ms: float            # idle ms per step


def gap_groups(events, steps: int, *, min_us: float = 5.0, top: int = 10,
               step_range: str = "glm_ray_bench_step") -> list[GapGroup]:
    """The `top` (host event, next kernel) groups by idle time per step, over the profiler `events` of
    `steps` steps (`prof.events()`); gaps shorter than `min_us` are ignored (a graph's own inter-kernel
    spacing). Only gaps inside a `step_range` range count (not the idle time between steps)."""
    kernels = sorted((ev.time_range.start, ev.time_range.end, ev.name) for ev in events
                     if ev.device_type == DeviceType.CUDA and ev.name != step_range)
    host = sorted(((ev.time_range.start, ev.time_range.end, ev.name) for ev in events
                   if ev.device_type == DeviceType.CPU), key=lambda e: (e[0], -e[1]))
    starts = [h[0] for h in host]
    ranges = [(s, e) for s, e, n in host if n == step_range]
    groups: dict[tuple[str, str], list[float]] = {}
    end = kernels[0][1] if kernels else 0.0
    for s, e, name in kernels[1:]:
        gap = s - end
        if gap >= min_us and any(r0 <= end and s <= r1 for r0, r1 in ranges):
            inner = _innermost(host, starts, end + gap / 2)
            key = (inner or "(no host event)", name[:60])
            groups.setdefault(key, []).append(gap)
        end = max(end, e)
    out = [GapGroup(h, k, len(v) / steps, sum(v) / steps / 1e3) for (h, k), v in groups.items()]
    return sorted(out, key=lambda g: -g.ms)[:top]


def _innermost(host: list[tuple[float, float, str]], starts: list[float], t: float) -> str | None:
    """The name of the host event covering time t that started last (nested ranges: the innermost)."""
    i = bisect.bisect_right(starts, t) - 1
    while i >= 0:
        if host[i][1] >= t:
            return host[i][2]
        i -= 1
    return None


def print_gap_groups(groups: list[GapGroup]) -> None:
    if not groups:
        return
    print("  GPU gaps by host event at the gap / next kernel (per step):")
    print(f"  {'ms':>8} {'gaps':>6}  host event -> next kernel")
    for g in groups:
        print(f"  {g.ms:>8.3f} {g.count:>6.1f}  {g.host[:50]} -> {g.next_kernel}")


__all__ = ["GapGroup", "gap_groups", "print_gap_groups"]
