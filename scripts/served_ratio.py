"""Issue #19's ratio: served ITL (a `glm-ray bench --output-file` JSONL) vs the offline decode step
(a `bench.offline --json` JSONL) at the same batch = concurrency, one line per C.

    python3 scripts/served_ratio.py SERVED.jsonl OFFLINE.jsonl
"""
import json
import sys


def main(served_path: str, offline_path: str) -> None:
    served = [json.loads(line) for line in open(served_path)]
    off = {r["batch"]: r for r in map(json.loads, open(offline_path))}
    for r in served:
        c, itl, med = r.get("max_concurrency"), r.get("mean_itl_ms"), r.get("median_itl_ms")
        o = off.get(c)
        if o and itl:
            step = o["decode_step_ms"]
            print(f"C={c}: served ITL mean {itl:.2f} / median {med:.2f} ms, offline decode step {step:.2f} ms, "
                  f"ratio mean {itl / step:.3f} median {med / step:.3f}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
