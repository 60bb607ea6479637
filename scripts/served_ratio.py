"""Issue #19's ratio: served ITL (a `glm-ray bench --output-file` JSONL) vs the offline decode step
(a `bench.offline --json` JSONL) at the same batch = concurrency, one line per C. With the server's log
(third argument), also the engine's own ITL from its stats lines ("ITL in the engine X ms mean, N tokens"; a
window counts for the smallest bench C at or above its "running" count and its decode median's batch, never a C
the bench ran before the previous window's, weighted by its tokens), which splits the ratio into its two factors: served / engine ITL (what the path
after the engine adds: the loop, the Router, Serve's streaming) and engine ITL / offline step (what the
prefill steps interleaved with the decodes add).

    python3 scripts/served_ratio.py SERVED.jsonl OFFLINE.jsonl [SERVE.log]
"""
import json
import re
import sys

_LINE = re.compile(r"engine: prompt .*?running (\d+),.*?ITL in the engine ([\d.]+) ms mean \([\d.]+ median\), (\d+) tokens")
_BATCH = re.compile(r"decode steps: [\d.]+ ms median at batch (\d+)")


def engine_itl_by_concurrency(log_path: str, concurrencies: list[int]) -> dict[int, float]:
    """The engine's ITL per bench concurrency, `concurrencies` in the order the bench ran them: each stats window
    goes to the first C (in that order, from the previous window's on) at or above both its `running` count and
    the batch of its decode median (`running` is a snapshot: between a C's waves, and in the drain after its last
    one, it reads less than C; the windows come in time order, so one cannot belong to a C that ran before the
    previous window's), and a C's ITL is the mean of its windows' means weighted by their token counts (ms)."""
    order = list(concurrencies)
    acc: dict[int, list[tuple[float, int]]] = {}
    at = 0                                          # index in `order` of the previous window's C
    with open(log_path, errors="replace") as f:
        for line in f:
            m = _LINE.search(line)
            if not m:
                continue
            running, itl, n = int(m.group(1)), float(m.group(2)), int(m.group(3))
            b = _BATCH.search(line)
            need = max(running, int(b.group(1)) if b else 0)
            i = next((i for i in range(at, len(order)) if order[i] >= need), None)
            if i is not None and n:
                at = i
                acc.setdefault(order[i], []).append((itl, n))
    return {c: sum(i * n for i, n in v) / sum(n for _, n in v) for c, v in acc.items()}


def main(served_path: str, offline_path: str, log_path: str | None = None) -> None:
    served = [json.loads(line) for line in open(served_path)]
    off = {r["batch"]: r for r in map(json.loads, open(offline_path))}
    eng = engine_itl_by_concurrency(log_path, [r["max_concurrency"] for r in served]) if log_path else {}
    for r in served:
        c, itl, med = r.get("max_concurrency"), r.get("mean_itl_ms"), r.get("median_itl_ms")
        o = off.get(c)
        if o and itl:
            step = o["decode_step_ms"]
            line = (f"C={c}: served ITL mean {itl:.2f} / median {med:.2f} ms, offline decode step {step:.2f} ms, "
                    f"ratio mean {itl / step:.3f} median {med / step:.3f}")
            if c in eng:
                line += (f"; engine ITL {eng[c]:.2f} ms (token-weighted over its stats windows): served / engine "
                         f"{itl / eng[c]:.3f}, engine / offline step {eng[c] / step:.3f}")
            print(line)


if __name__ == "__main__":
    main(*sys.argv[1:4])
