"""A/B in one process, interleaved: `build_forward_batch` of an older commit (its forward_batch.py saved as
OLD.py) vs the checkout's, host time per call on the CPU (device=cpu, one thread).

    git show d9a087d:glm_ray/forward_batch.py > /tmp/ab/fb_old.py
    python ab_build_forward_batch.py /tmp/ab/fb_old.py
"""
from __future__ import annotations

import importlib.util
import sys
import time

import torch

from glm_ray.forward_batch import build_forward_batch as new
from glm_ray.forward_batch import contiguous_block_tables

CASES = {"prefill 8x1024": ([1024] * 8, [1024] * 8), "prefill 1x8192": ([8192], [8192]),
         "mixed 12 dec + 1x2048 tail after 2048": ([1] * 12 + [128], [1500] * 12 + [2176]),
         "decode 64 @1k": ([1] * 64, [1024] * 64), "decode 1 @1k": ([1], [1024])}


def main() -> None:
    spec = importlib.util.spec_from_file_location("fb_old", sys.argv[1])
    old = sys.modules["fb_old"] = importlib.util.module_from_spec(spec)     # dataclasses look it up
    spec.loader.exec_module(old)
    torch.set_num_threads(1)
    for name, (ql, cl) in CASES.items():
        bt = contiguous_block_tables(cl, 64)
        res = {"old": [], "new": []}
        for _ in range(7):
            for tag, f in (("old", old.build_forward_batch), ("new", new)):
                t = time.perf_counter()
                for _ in range(50):
                    f(ql, cl, bt, 64, torch.device("cpu"))
                res[tag].append((time.perf_counter() - t) / 50 * 1e3)
        o, n = sorted(res["old"])[3], sorted(res["new"])[3]
        print(f"{name:40s} old {o:.3f} ms  new {n:.3f} ms  {o / n:.2f}x")


if __name__ == "__main__":
    main()
