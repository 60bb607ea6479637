"""Issue #19's ratio: served ITL (a `glm-ray bench --output-file` JSONL) vs the offline decode step
(a `bench.offline --json` JSONL) at the same batch = concurrency, one line per C. With the server's log
(third argument), also the engine's own ITL from its stats lines ("ITL in the engine X ms mean", windows whose
"running" count equals C), which splits the ratio into its two factors: served / engine ITL (what the path
after the engine adds: the loop, the Router, Serve's streaming) and engine ITL / offline step (what the
prefill steps interleaved with the decodes add).

    python3 scripts/served_ratio.py SERVED.jsonl OFFLINE.jsonl [SERVE.log]
"""
import json
import re
import statistics
import sys

_LINE = re.compile(r"engine: prompt .*?running (\d+),.*?ITL in the engine ([\d.]+) ms mean")


def engine_itl_by_running(log_path: str) -> dict[int, float]:
    """running count -> the median over its stats windows of the engine's mean ITL (ms)."""
    by: dict[int, list[float]] = {}
    with open(log_path, errors="replace") as f:
        for line in f:
            m = _LINE.search(line)
            if m:
                by.setdefault(int(m.group(1)), []).append(float(m.group(2)))
    return {r: statistics.median(v) for r, v in by.items()}


def main(served_path: str, offline_path: str, log_path: str | None = None) -> None:
    served = [json.loads(line) for line in open(served_path)]
    off = {r["batch"]: r for r in map(json.loads, open(offline_path))}
    eng = engine_itl_by_running(log_path) if log_path else {}
    for r in served:
        c, itl, med = r.get("max_concurrency"), r.get("mean_itl_ms"), r.get("median_itl_ms")
        o = off.get(c)
        if o and itl:
            step = o["decode_step_ms"]
            line = (f"C={c}: served ITL mean {itl:.2f} / median {med:.2f} ms, offline decode step {step:.2f} ms, "
                    f"ratio mean {itl / step:.3f} median {med / step:.3f}")
            if c in eng:
                line += (f"; engine ITL {eng[c]:.2f} ms (windows at running {c}): served / engine "
                         f"{itl / eng[c]:.3f}, engine / offline step {eng[c] / step:.3f}")
            print(line)


if __name__ == "__main__":
    main(*sys.argv[1:4])
