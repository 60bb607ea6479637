"""Per-step orchestration overhead of the engine's step loop: how much of a decode step is spent
getting the step to every TP rank and the sampled tokens back, versus inside the workers, and whether the
device waits for the host between steps.

    python -m glm_ray.bench.orchestration [MODEL] --tp 1 2 --modes local compiled actor --batch 8 \
        --scheduling sync async

Prints one row per (tp, mode, scheduling), medians over the decode steps: the step's wall time,
orchestration overhead (execute wall time minus the workers' own prepare+forward+sample) and its share,
host scheduling + bookkeeping (`sched+update`), and from the device's own clock (GLM_RAY_STEP_TIMELINE,
worker/step_timeline.py) the step's device time and the device's idle `gap` before each step (a GPU: CUDA
events; the CPU: wall-clock marks, so there the gap is the host's work between two steps' compute).
`local` is the in-process executor (what the served loop in rank 0's actor runs at TP=1).
"""
from __future__ import annotations

import argparse
import gc
import os

import torch

from glm_ray import envs
from glm_ray.bench.table import append_rows
from glm_ray.engine.engine_core import summarize_steps
from glm_ray.engine.sampling_params import SamplingParams
from glm_ray.llm import LLM


def measure(model, tp: int, mode: str, batch: int, steps: int, scheduling: str | None = None, **kw) -> dict:
    if mode != "local":
        os.environ[envs.ORCHESTRATION.name] = mode
    if scheduling is not None:
        kw["async_scheduling"] = scheduling == "async"
    llm = LLM(model, executor="local" if mode == "local" else "ray", tensor_parallel_size=tp,
              max_num_seqs=batch, kv_cache_memory_bytes=1 << 30, **kw)
    V = llm.engine.model_cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, V, (32,), generator=g).tolist()} for _ in range(batch)]
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)       # warm-up
    llm.engine.step_history.clear()
    llm.generate(prompts, SamplingParams(max_tokens=steps, ignore_eos=True, temperature=0), use_tqdm=False)
    row = {"tp": tp, "mode": mode if mode == "local" else getattr(llm.engine.executor, "orchestration", mode),
           "scheduling": "async" if llm.engine.async_scheduling else "sync",
           "batch": batch, **summarize_steps(list(llm.engine.step_history))}
    if mode != "local":
        llm.engine.executor.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--modes", nargs="+", default=["local", "compiled", "actor"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--scheduling", nargs="+", choices=["sync", "async"], default=[None],
                   help="the step loop (default: the engine's default for the device)")
    p.add_argument("--json", default=None)
    p.add_argument("--time-collectives", action="store_true",
                   help="time TP all-reduce/all-gather on rank 0 (adds a sync per step on GPUs)")
    a = p.parse_args(argv)
    if a.time_collectives:
        os.environ[envs.TIME_COLLECTIVES.name] = "1"       # inherited by the worker actors
    os.environ[envs.STEP_TIMELINE.name] = "1"               # device time and inter-step gap (no extra sync)
    if set(a.modes) - {"local"}:      # Ray only for the TP-rank actors: the local row runs where Ray is absent
        import ray  # noqa: PLC0415
        if not ray.is_initialized():
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1",
                     num_cpus=max(8, os.cpu_count() or 1), object_store_memory=500 * 2**20)
    rows = []
    for tp in a.tp:
        for mode in a.modes:
            if mode == "local" and tp != 1:
                continue
            for scheduling in a.scheduling:
                rows.append(measure(a.model, tp, mode, a.batch, a.steps, scheduling, device=a.device,
                                    dtype=a.dtype, load_format=a.load_format))
                r = rows[-1]
                print(f"tp={r['tp']} {r['mode']:>15} {r['scheduling']:>5} batch={r['batch']}: "
                      f"step {r.get('step_ms', 0):8.3f} ms  "
                      f"orchestration {r.get('orchestration_ms', 0):7.3f} ms ({100 * r.get('orchestration_share', 0):5.1f}%)  "
                      f"sched+update {r.get('schedule_update_ms', 0):6.3f} ms  "
                      f"device {r.get('device_ms', 0):8.3f} ms  gap {r.get('gap_ms', 0):7.3f} ms "
                      f"({100 * r.get('gap_share', 0):5.1f}%)  "
                      f"collectives {r.get('collectives_ms', 0):7.3f} ms ({100 * r.get('collectives_share', 0):5.1f}%)",
                      flush=True)
    append_rows(a.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
