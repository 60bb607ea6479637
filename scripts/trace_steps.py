"""Per-step GPU idle gaps in a Chrome trace written by `bench.prefill --trace` / `bench.decode`'s profiler.

    python scripts/trace_steps.py TRACE.json [--min-us 50] [--top 8]

For each `glm_ray_bench_step` range: its wall time, the GPU's busy time inside it, and its largest gaps
between kernels, each with the innermost host op running at the gap's midpoint and the ops that ran
on the host during it (what the GPU waited for). `bench.gaps` gives the same grouped over steps; this
shows whether a stretch is every step's or one step's (a first-call or profiler start-up cost).
"""
from __future__ import annotations

import argparse
import bisect
import json

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATS = {"cpu_op", "cuda_runtime", "cuda_driver", "user_annotation", "python_function"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace")
    p.add_argument("--min-us", type=float, default=50.0)
    p.add_argument("--top", type=int, default=8)
    a = p.parse_args()
    ev = json.load(open(a.trace))
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    xs = [e for e in ev if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in xs
                   if e["name"] == "glm_ray_bench_step" and e.get("cat") == "user_annotation")
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in xs if e.get("cat") in DEVICE_CATS)
    host = sorted(((e["ts"], e["ts"] + e["dur"], e["name"]) for e in xs
                   if e.get("cat") in HOST_CATS and e["name"] != "glm_ray_bench_step"), key=lambda h: (h[0], -h[1]))
    hstarts = [h[0] for h in host]
    for i, (s0, s1) in enumerate(steps):
        ks = [k for k in kernels if s0 <= k[0] < s1]
        if not ks:
            continue
        busy = sum(k[1] - k[0] for k in ks)
        gaps, end = [], ks[0][1]
        for s, e, name in ks[1:]:
            if s - end >= a.min_us:
                gaps.append((s - end, end, s, name))
            end = max(end, e)
        print(f"step {i}: wall {(s1 - s0) / 1e3:.2f} ms, host before first kernel {(ks[0][0] - s0) / 1e3:.2f} ms, "
              f"gpu busy {busy / 1e3:.2f} ms, gaps >= {a.min_us:.0f} us: {len(gaps)} = "
              f"{sum(g[0] for g in gaps) / 1e3:.2f} ms")
        for g, g0, g1, name in sorted(gaps, reverse=True)[:a.top]:
            during = {}                                     # host time inside the gap per op name
            for h in host[:bisect.bisect_right(hstarts, g1)]:
                if h[1] > g0:                               # overlaps it (also ops begun before it)
                    during[h[2]] = during.get(h[2], 0.0) + min(h[1], g1) - max(h[0], g0)
            top = sorted(during.items(), key=lambda kv: -kv[1])[:4]
            print(f"  {g / 1e3:7.2f} ms before {name[:50]}: "
                  + ", ".join(f"{n[:40]} {t / 1e3:.2f}" for n, t in top))


if __name__ == "__main__":
    main()
