"""Prefix caching on vs off inside one engine: the shared-prefix workload driven straight into the
`EngineCore` (no Ray, no HTTP), so the TTFT it reports is the engine's own and the served number
(`scripts/prefix_cache_ab.sh`, `glm-ray bench`) can be split into engine and path around it.

    python -m glm_ray.bench.shared_prefix                                   # tiny model, CPU
    python -m glm_ray.bench.shared_prefix glm5-flash-31b --quant fp8 --device cuda --dtype bfloat16 \\
        --gsp-num-groups 32 --gsp-prompts-per-group 16 --gsp-system-prompt-len 2048 \\
        --gsp-question-len 128 --gsp-output-len 128 --concurrency 16 --max-model-len 4096

The workload is `glm-ray bench --dataset-name generated-shared-prefix` (sglang's shape: G groups of a
P-token system prompt, Q questions each, shuffled), greedy, `ignore_eos`, run closed-loop at
`--concurrency` C: a client adds its next prompt the moment its previous one finished (after the step
that finished it), as `--max-concurrency` does. One engine runs every mode (`--modes on off`,
alternating over `--repeats` rounds), the unheld cached blocks forgotten before each run, after a
discarded warm-up of two other groups — the same process, weights, graphs and allocator for both. Mode
`on-copies` is the cache on without in-flight prefix sharing (engine/scheduler.py): requests admitted while
another one computes their new prefix compute a copy of it, as before that existed (the A/B of that policy);
`on-lpm` the cache on with the scheduler's `lpm` policy (cache hits first; the others run the engine's
`--schedule-policy`, fcfs by default).

Per run: the engine's TTFT (arrival -> first token; queued = arrival -> first scheduled; the median apart for
the requests that found a cached prefix and those that did not), the number of
engine steps a request waited for its first token, output throughput, the hit rate (cached / looked-up
prompt tokens), and the median wall time of the engine's pure-decode and prefill/mixed steps (a step's
wall time under async scheduling is "launch N+1, read N back"). Greedy outputs are compared across
modes per prompt; on CPU fp32 they must match exactly (a caching bug shows here first).
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from glm_ray.bench.datasets import DatasetRow, shared_prefix_rows
from glm_ray.bench.decode import model_dir_for
from glm_ray.bench.table import append_rows, print_rows
from glm_ray.engine.engine_core import EngineCore
from glm_ray.engine.sampling_params import SamplingParams
from glm_ray.llm import LLM

COLS = ("concurrency", "mode", "rep", "absorb", "hit_rate", "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "hit_median_ttft_ms", "queued_ms",
        "steps_to_first", "output_tok_s", "decode_step_ms", "mixed_step_ms", "mixed_tokens")


def run_workload(engine: EngineCore, rows: list[DatasetRow], concurrency: int) -> tuple[dict, dict[int, list[int]]]:
    """Run `rows` closed-loop at `concurrency`; returns the run's summary and each row's output ids."""
    pending = list(enumerate(rows))[::-1]                      # pop() -> the next row
    active: dict[str, int] = {}                                # request id -> row index
    added_at_step: dict[str, int] = {}
    outputs: dict[int, list[int]] = {}
    ttft, queued, waited, decode_ms, mixed_ms, mixed_tokens = [], [], [], [], [], []
    hit_ttft, miss_ttft = [], []                                # by whether the request found a cached prefix
    q0, h0 = engine.kv.prefix_queries, engine.kv.prefix_hits
    n_out, step_no, t_start = 0, 0, time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and len(active) < concurrency:
            i, row = pending.pop()
            rid = f"gsp-{id(rows)}-{i}"
            engine.add_request(rid, list(row.prompt_ids),
                               SamplingParams(max_tokens=row.output_len, temperature=0.0, ignore_eos=True))
            active[rid], added_at_step[rid], outputs[i] = i, step_no, []
        t0 = time.perf_counter()
        deltas = engine.step()
        wall_ms = (time.perf_counter() - t0) * 1e3
        step_no += 1
        s = engine.last_stats
        if deltas and s.num_tokens:                             # the step whose results these are
            (mixed_ms if s.num_prefill_tokens else decode_ms).append(wall_ms)
            if s.num_prefill_tokens:
                mixed_tokens.append(s.num_prefill_tokens)
        for d in deltas:
            if d.error:
                raise RuntimeError(f"request {d.request_id} failed: {d.error}")
            i = active[d.request_id]
            outputs[i].extend(d.new_token_ids)
            n_out += len(d.new_token_ids)
            if d.first_token_time is not None:
                ttft.append(d.first_token_time - d.arrival_time)
                (hit_ttft if d.num_cached_tokens else miss_ttft).append(ttft[-1])
                queued.append((d.first_scheduled_time or d.arrival_time) - d.arrival_time)
                waited.append(step_no - added_at_step[d.request_id])
            if d.finished:
                del active[d.request_id]
    dur = time.perf_counter() - t_start
    q, h = engine.kv.prefix_queries - q0, engine.kv.prefix_hits - h0
    ms = sorted(1e3 * x for x in ttft)
    summary = {
        "requests": len(rows), "hit_rate": h / q if q else 0.0,
        "mean_ttft_ms": statistics.fmean(ms), "median_ttft_ms": statistics.median(ms),
        "p90_ttft_ms": ms[min(len(ms) - 1, int(0.9 * len(ms)))], "queued_ms": 1e3 * statistics.fmean(queued),
        "steps_to_first": statistics.median(waited),
        "hit_median_ttft_ms": 1e3 * statistics.median(hit_ttft) if hit_ttft else float("nan"),
        "miss_median_ttft_ms": 1e3 * statistics.median(miss_ttft) if miss_ttft else float("nan"),
        "hit_requests": len(hit_ttft), "output_tok_s": n_out / dur, "duration_s": dur,
        "decode_step_ms": statistics.median(decode_ms) if decode_ms else float("nan"),
        "mixed_step_ms": statistics.median(mixed_ms) if mixed_ms else float("nan"),
        "mixed_tokens": int(statistics.median(mixed_tokens)) if mixed_tokens else 0,
        "decode_steps": len(decode_ms), "mixed_steps": len(mixed_ms),
    }
    return summary, outputs


def run(model: str | None, *, modes=("on", "off"), repeats: int = 1, concurrency=(4,), num_groups: int = 8,
        prompts_per_group: int = 8, system_prompt_len: int = 1024, question_len: int = 32, output_len: int = 16,
        warmup_groups: int = 2, seed: int = 0, absorb: tuple[int | None, ...] = (None,),
        **engine_kw) -> tuple[list[dict], dict]:
    """Every (concurrency, mode, absorb) row (modes alternating over `repeats` rounds per concurrency, each
    round's modes under each `absorb` setting in turn: the runner's absorbed-tail threshold, None = the
    backend's, for an A/B in one process) and the output comparison (first run of each mode)."""
    llm = LLM(model, **engine_kw)
    eng = llm.engine
    runner = getattr(getattr(eng.executor, "worker", None), "runner", None)   # the in-process runner (TP 1)
    default_absorb = runner.absorb_tokens if runner is not None else None
    V = eng.model_cfg.vocab_size
    shape = dict(prompts_per_group=prompts_per_group, system_prompt_len=system_prompt_len,
                 question_len=question_len, output_len=output_len, vocab_size=V)
    rows = shared_prefix_rows(np.random.default_rng(seed), num_groups=num_groups, **shape)
    if warmup_groups:                                          # other prefixes: first-use costs, discarded
        warm = shared_prefix_rows(np.random.default_rng(seed + 7), num_groups=warmup_groups, **shape)
        for m in dict.fromkeys(modes):
            eng.set_prefix_caching(m != "off")
            run_workload(eng, warm, max(concurrency))
    order = [m for r in range(repeats) for m in (modes if r % 2 == 0 else modes[::-1])]
    results, outs = [], {}
    for c in concurrency:
        for rep, (mode, ab) in enumerate((m, ab) for m in order for ab in absorb):
            if runner is not None:
                runner.absorb_tokens = default_absorb if ab is None else ab
            in_effect = eng.set_prefix_caching(mode != "off")  # also forgets the unheld cached blocks
            eng.scheduler.share_inflight_prefixes = mode != "on-copies"
            eng.scheduler.policy = "lpm" if mode == "on-lpm" else eng.cfg.scheduler.policy
            summary, out = run_workload(eng, rows, c)
            results.append({"concurrency": c, "mode": mode if in_effect or mode == "off" else f"{mode}(n/a)",
                            "rep": rep, **({"absorb": runner.absorb_tokens} if runner is not None else {}),
                            **summary})
            print("  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in results[-1].items()),
                  flush=True)                                  # as it comes: a long run cut short keeps its rows
            outs.setdefault(mode, out)
    same = {}
    if "off" in outs and len(outs) > 1:
        b = outs["off"]
        same = {m: {"rows": len(a), "identical": sum(a[i] == b[i] for i in a)} for m, a in outs.items() if m != "off"}
    return results, same


def ratios(rows: list[dict]) -> dict[str, float]:
    """off/on for the TTFTs, on/off for throughput, over the mean of each mode's runs (of one concurrency)."""
    def mean(mode, k):
        xs = [r[k] for r in rows if r["mode"] == mode]
        return statistics.fmean(xs) if xs else float("nan")
    return {"mean_ttft_off_over_on": mean("off", "mean_ttft_ms") / mean("on", "mean_ttft_ms"),
            "median_ttft_off_over_on": mean("off", "median_ttft_ms") / mean("on", "median_ttft_ms"),
            "throughput_on_over_off": mean("on", "output_tok_s") / mean("off", "output_tok_s")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="a model directory, or with --quant a bundled config name (glm5-flash-31b, ...); "
                        "default: the tiny model")
    p.add_argument("--quant", choices=["fp8", "bf16"], default=None,
                   help="rewrite the config to this checkpoint format and load dummy weights")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--schedule-policy", choices=["fcfs", "lpm"], default="fcfs")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--gsp-num-groups", type=int, default=8)
    p.add_argument("--gsp-prompts-per-group", type=int, default=8)
    p.add_argument("--gsp-system-prompt-len", type=int, default=1024)
    p.add_argument("--gsp-question-len", type=int, default=32)
    p.add_argument("--gsp-output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, nargs="+", default=[4],
                   help="closed-loop clients; several values run one after another on the same engine")
    p.add_argument("--modes", nargs="+", choices=["on", "off", "on-copies", "on-lpm"], default=["on", "off"],
                   help="on-copies: the cache on, in-flight prefix sharing off (each concurrent copy computes it); "
                        "on-lpm: the cache on, the lpm schedule policy")
    p.add_argument("--repeats", type=int, default=1, help="rounds of --modes (order alternates)")
    p.add_argument("--warmup-groups", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--absorb", type=int, nargs="+", default=None, metavar="N",
                   help="run every mode under each of these absorbed-tail thresholds in turn, in this one process "
                        "(the runner's GLM_RAY_ABSORB_PREFILL_TOKENS; 0 = cached tails as naive prefill groups)")
    p.add_argument("--json", default=None, help="also append the rows to this JSONL file")
    a = p.parse_args(argv)
    tmp = None
    model, load_format = a.model, a.load_format
    if a.quant:
        tmp = Path(tempfile.mkdtemp(prefix="glm-ray-gsp-"))
        model, load_format = str(model_dir_for(a.model or "glm5-tiny", a.quant, tmp)), "dummy"
    kv = int(a.kv_cache_memory_gb * 2**30) if a.kv_cache_memory_gb else None
    try:
        rows, same = run(model, modes=tuple(a.modes), repeats=a.repeats, concurrency=tuple(a.concurrency),
                         num_groups=a.gsp_num_groups, prompts_per_group=a.gsp_prompts_per_group,
                         system_prompt_len=a.gsp_system_prompt_len, question_len=a.gsp_question_len,
                         output_len=a.gsp_output_len, warmup_groups=a.warmup_groups, seed=a.seed,
                         absorb=tuple(a.absorb) if a.absorb else (None,),
                         device=a.device, dtype=a.dtype, load_format=load_format, max_num_seqs=a.max_num_seqs,
                         max_model_len=a.max_model_len, max_num_batched_tokens=a.max_num_batched_tokens,
                         kv_cache_memory_bytes=kv, enforce_eager=a.enforce_eager, schedule_policy=a.schedule_policy)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    print_rows(rows, COLS, width=14)
    for c in a.concurrency:
        for ab in dict.fromkeys(r.get("absorb") for r in rows):
            at_c = [r for r in rows if r["concurrency"] == c and r.get("absorb") == ab]
            if {"on", "off"} <= {r["mode"] for r in at_c}:
                tag = f" absorb={ab}" if a.absorb else ""
                print(f"C={c}{tag}: " + "  ".join(f"{k} {v:.2f}" for k, v in ratios(at_c).items()))
    for m, v in same.items():
        print(f"greedy outputs identical, {m} vs off: {v['identical']} / {v['rows']} prompts")
    append_rows(a.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
