#!/usr/bin/env python3
"""Served ITL of the tiny model on this machine's CPU: the engine loop in the Router (engine_in_worker
false) vs in rank 0's actor (the default), interleaved A/B, 4 repetitions, C concurrent streams of 64
tokens. Prints each repetition's mean ITL and the median.

    RAY_AUTH_MODE=disabled .venv/bin/python scripts/itl_engine_location.py TP C
"""
from __future__ import annotations

import statistics
import sys
import threading
import time

import ray
from openai import OpenAI
from ray import serve

from glm_ray.serve.app import build_app


def _stream(client: OpenAI, out: list[float]) -> None:
    s = client.completions.create(model="m", prompt=[11, 12, 13, 14, 15, 16, 17, 18], max_tokens=64, temperature=0,
                                  stream=True, extra_body={"ignore_eos": True})
    ts = [time.perf_counter() for ch in s if ch.choices and ch.choices[0].text is not None]
    out.extend(b - a for a, b in zip(ts[1:], ts[2:]))          # from the second token on


def main(tp: int, concurrency: int, reps: int = 4) -> None:
    ray.init(address="local", num_cpus=6, include_dashboard=False)
    clients = {}
    for in_worker in (False, True):
        name = f"m{int(in_worker)}"
        serve.run(build_app({"model": "tiny", "device": "cpu", "tp": tp, "engine_in_worker": in_worker,
                             "served_model_name": "m"}), name=name, route_prefix=f"/{name}")
        clients[in_worker] = OpenAI(base_url=f"http://127.0.0.1:8000/{name}/v1", api_key="x")
    res: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(reps):
        for in_worker in (False, True):                           # interleaved A/B
            itl: list[float] = []
            threads = [threading.Thread(target=_stream, args=(clients[in_worker], itl)) for _ in range(concurrency)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            res[in_worker].append(statistics.mean(itl) * 1e3)
    for in_worker in (False, True):
        print(f"tp={tp} C={concurrency} engine_in_worker={in_worker}: mean ITL per rep (ms)",
              [f"{x:.2f}" for x in res[in_worker]], "median", f"{statistics.median(res[in_worker]):.2f}")
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
