"""A/B in one process, interleaved: a step's penalties from the host lists (`sampler._penalize`, what every
step did before worker/penalties.py) vs the device-resident tables (`PenaltyBatch.apply` + `record`, rows
already made: the steady state of a decode step). Equal logits asserted. CPU only here (no copy cost: on a
GPU the host-list form also uploads the flattened histories every step and, under async scheduling, waited
for the previous step's tokens first; neither is in these numbers).

    python docs/measurements/2026-12-05/penalties-cpu/ab_penalty_tables.py [--vocab 154880]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from glm_ray import SamplingParams
from glm_ray.worker.penalties import PenaltyState
from glm_ray.worker.sampler import SamplingRow, _penalize


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=154880)
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    p = SamplingParams(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2)
    print(f"{'rows':>5} {'prompt':>7} {'output':>7} {'host lists ms':>14} {'tables ms':>10} {'ratio':>6}")
    for n, plen, olen in ((8, 1024, 256), (32, 2048, 512), (64, 8192, 256)):
        rows = [SamplingRow(p, None, torch.randint(0, a.vocab, (plen,), generator=g).tolist(),
                            torch.randint(0, a.vocab, (olen,), generator=g).tolist(), (1,)) for _ in range(n)]
        logits = torch.randn(n, a.vocab, generator=g)
        state = PenaltyState(a.vocab, torch.device("cpu"))
        ids = [f"r{i}" for i in range(n)]
        batch = state.batch(list(range(n)), ids, [p] * n, [(r.prompt_ids, r.output_ids) for r in rows])
        assert torch.equal(batch.apply(logits), _penalize(logits, rows))
        t = {"host": [], "tables": []}
        for _ in range(a.reps):
            for tag in ("host", "tables"):
                t0 = time.perf_counter()
                if tag == "host":
                    _penalize(logits, rows)
                else:
                    b = state.batch(list(range(n)), ids, [p] * n, [(r.prompt_ids, r.output_ids) for r in rows])
                    b.apply(logits)
                    b.record(torch.zeros(n, dtype=torch.long))
                t[tag].append((time.perf_counter() - t0) * 1e3)
        h, d = statistics.median(t["host"]), statistics.median(t["tables"])
        print(f"{n:>5} {plen:>7} {olen:>7} {h:>14.2f} {d:>10.2f} {h / d:>6.2f}")


if __name__ == "__main__":
    main()
