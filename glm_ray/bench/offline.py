"""Offline engine throughput: `LLM.generate` tokens/s at several batch sizes, and where a step's
time goes (Python scheduling + update vs the model forward vs sampling).

    python -m glm_ray.bench.offline [MODEL] --batch 1 16 64 --input-len 128 --output-len 64
    python -m glm_ray.bench.offline [MODEL] --scheduling sync async --repeats 3    # in-process A/B

`--scheduling sync async` runs both modes on one engine, interleaved (sync, async, async, sync, ...
`--repeats` rounds), so the A/B sees the same process, caches and clocks. decode_step_ms is the median
wall time of an engine step at full batch (pure decode); under async scheduling a step is "launch
N+1, then read N back", so its wall time is the served inter-token latency.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from glm_ray.bench.table import append_rows, print_rows
from glm_ray.engine.sampling_params import SamplingParams
from glm_ray.llm import LLM


def run(model: str | None, batches: list[int], input_len: int, output_len: int, scheduling=("sync",),
        repeats: int = 1, **engine_kw) -> list[dict]:
    llm = LLM(model, **engine_kw)
    V = llm.engine.model_cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": torch.randint(10, V, (input_len,), generator=g).tolist()}],
                 SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)          # warm-up
    order = [m for r in range(repeats) for m in (scheduling if r % 2 == 0 else scheduling[::-1])]
    rows = []
    for B in batches:
        prompts = [{"prompt_token_ids": torch.randint(10, V, (input_len,), generator=g).tolist()} for _ in range(B)]
        for rep, mode in enumerate(order):
            rows.append(_measure(llm, prompts, sp, mode) | {"batch": B, "input_len": input_len,
                                                            "output_len": output_len, "rep": rep})
    return rows


def _measure(llm: LLM, prompts: list[dict], sp: SamplingParams, mode: str) -> dict:
    """One generate of `prompts` under `mode` ("sync" | "async"), with every engine step timed."""
    eng = llm.engine
    mode = "async" if eng.set_async_scheduling(mode == "async") else "sync"
    B = len(prompts)
    steps = []
    orig_step = eng.step

    def timed_step():
        t0 = time.perf_counter()
        out = orig_step()
        s = eng.last_stats
        steps.append((time.perf_counter() - t0, s.schedule_s + s.update_s, s.worker_timings, s.num_decode_seqs,
                      s.num_tokens))
        return out
    eng.step = timed_step
    t0 = time.perf_counter()
    try:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    finally:
        eng.step = orig_step
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    decode = [s for s in steps if s[3] == B and s[4] == B]        # pure decode steps at full batch

    def med(xs):
        return statistics.median(xs) if xs else float("nan")
    step = med([s[0] for s in decode])
    prep = med([s[2].get("prepare", 0.0) for s in decode])
    py_sched = med([s[1] for s in decode])
    return {"scheduling": mode, "wall_s": dt, "output_tok_s": n_out / dt, "decode_step_ms": step * 1e3,
            "forward_ms": med([s[2].get("forward", 0.0) for s in decode]) * 1e3, "prepare_inputs_ms": prep * 1e3,
            "sample_ms": med([s[2].get("sample", 0.0) for s in decode]) * 1e3, "schedule_update_ms": py_sched * 1e3,
            "python_share": (py_sched + prep) / step if step else float("nan")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--scheduling", nargs="+", choices=["sync", "async"], default=["sync"],
                   help="engine loop(s) to measure, interleaved on one engine (async: --async-scheduling)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of the --scheduling modes (order alternates)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--json", default=None, help="also write the rows to this JSONL file")
    a = p.parse_args(argv)
    rows = run(a.model, a.batch, a.input_len, a.output_len, tuple(a.scheduling), a.repeats, dtype=a.dtype,
               device=a.device, kv_cache_memory_bytes=a.kv_cache_memory_bytes,
               load_format=a.load_format, tensor_parallel_size=a.tp, max_num_seqs=max(a.batch),
               max_num_batched_tokens=max(2048, a.input_len))
    print_rows(rows, ["batch", "scheduling", "output_tok_s", "decode_step_ms", "forward_ms", "prepare_inputs_ms", "sample_ms",
                      "schedule_update_ms", "python_share"])
    append_rows(a.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
