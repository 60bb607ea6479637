"""A/B in one process, interleaved: the sampler's `_penalize` of an older commit (its sampler.py saved as
OLD.py) vs the checkout's, on the CPU (one thread, vocab 8192); asserts equal outputs first.

    git show 921b278:glm_ray/worker/sampler.py > /tmp/ab/sampler_old.py
    python ab_penalties.py /tmp/ab/sampler_old.py
"""
from __future__ import annotations

import importlib.util
import sys
import time

import torch

from glm_ray import SamplingParams
from glm_ray.worker import sampler as new


def main() -> None:
    spec = importlib.util.spec_from_file_location("sampler_old", sys.argv[1])
    old = sys.modules["sampler_old"] = importlib.util.module_from_spec(spec)   # dataclasses look it up
    spec.loader.exec_module(old)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    for n, plen, olen in [(8, 1024, 64), (64, 1024, 128)]:
        logits = torch.randn(n, 8192, generator=g)
        p = SamplingParams(repetition_penalty=1.1, frequency_penalty=0.2)
        rows = [new.SamplingRow(p, None, torch.randint(0, 8192, (plen,), generator=g).tolist(),
                                torch.randint(0, 8192, (olen,), generator=g).tolist(), (1,)) for _ in range(n)]
        assert torch.equal(old._penalize(logits, rows), new._penalize(logits, rows))
        res = {"old": [], "new": []}
        for _ in range(5):
            for tag, f in (("old", old._penalize), ("new", new._penalize)):
                t = time.perf_counter()
                for _ in range(10):
                    f(logits, rows)
                res[tag].append((time.perf_counter() - t) / 10 * 1e3)
        o, m = sorted(res["old"])[2], sorted(res["new"])[2]
        print(f"penalties N={n} prompt={plen} output={olen}: old {o:.3f} ms new {m:.3f} ms  {o / m:.2f}x (equal outputs)")


if __name__ == "__main__":
    main()
