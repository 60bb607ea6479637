"""Profile a few engine steps (torch.profiler), print the top ops by host and device time.

    python scripts/profile_step.py MODEL --device cuda --dtype bfloat16 --batch 8
    python scripts/profile_step.py MODEL --load-format dummy --batch 15 --prefix 2048 --prefill 128
    python scripts/profile_step.py MODEL --load-format dummy --batch 12 --prefix 2048 --prefill 128 --joining 4

Without --prefill: five pure-decode steps of --batch sequences. With --prefill N: the steps that admit one
more request of --prefix + N prompt tokens while the batch decodes (a mixed step, as a served request
joining a busy server meets it); with --prefix P its first P tokens were computed by an earlier request
(prefix cache), so only the N-token tail is prefilled. --joining J: J such requests join in the same step, each
with its own cached prefix (issue #22's served mixed steps: ~4 tails of 128 tokens over 2k prefixes beside ~12
decodes). Each profiled step's host split (schedule / execute / update) is printed beside its wall time.
--cprofile ROWS: then one more such step under cProfile (no torch profiler), its Python time by function — which
of the host's launches and bookkeeping a host-bound step spends its time in.
"""
import argparse
import logging
import os

import torch
from torch.profiler import ProfilerActivity, profile

from glm_ray import LLM, SamplingParams, envs
from glm_ray.kernels.cuda.compile_log import CompileLog

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("--device", default="cuda")
p.add_argument("--dtype", default="bfloat16")
p.add_argument("--batch", type=int, default=8)
p.add_argument("--load-format", default="auto")
p.add_argument("--rows", type=int, default=25)
p.add_argument("--prefill", type=int, default=0, help="prompt tokens (past --prefix) of the request joining")
p.add_argument("--prefix", type=int, default=0, help="its prompt tokens already in the prefix cache")
p.add_argument("--joining", type=int, default=1, help="requests joining in the same step, each its own prefix")
p.add_argument("--kv-cache-gb", type=float, default=1.0)
p.add_argument("--cprofile", type=int, default=0, metavar="ROWS",
               help="then the same joining step again (new tails on the same prefixes) under cProfile: the host's "
                    "Python time by function (ROWS rows by self time, then by cumulative time)")
p.add_argument("--log-compiles", action="store_true",
               help="log every Triton compile from start-up on (the kernel warm-up's and the first request's too)")
a = p.parse_args()
if a.log_compiles:
    os.environ[envs.LOG_TRITON_COMPILES.name] = "1"
    logging.basicConfig(format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
    logging.getLogger("glm_ray.kernels.cuda.compile_log").setLevel(logging.INFO)
    logging.getLogger("glm_ray.worker.warmup").setLevel(logging.INFO)
llm = LLM(a.model, device=a.device, dtype=a.dtype, kv_cache_memory_bytes=int(a.kv_cache_gb * (1 << 30)),
          max_num_seqs=a.batch + 2 * a.joining, max_model_len=max(2048, a.prefix + a.prefill + 128), load_format=a.load_format)
eng = llm.engine
g = torch.Generator().manual_seed(0)
greedy = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
prefixes = [torch.randint(10, 1000, (a.prefix,), generator=g).tolist() for _ in range(a.joining)]
if a.prefix:                                   # a finished request leaves each prefix's blocks cached
    llm.generate([{"prompt_token_ids": p + [7]} for p in prefixes], SamplingParams(max_tokens=1), use_tqdm=False)
for i in range(a.batch):
    eng.add_request(str(i), torch.randint(10, 1000, (32,), generator=g).tolist(), greedy)
for _ in range(8):
    eng.step()
n_steps = 5
if a.prefill:                                  # joining requests first: kernels compile, tiles autotune
    for j, p in enumerate(prefixes):
        eng.add_request(f"warm{j}", p + torch.randint(10, 1000, (a.prefill,), generator=g).tolist(), greedy)
    for _ in range(4):
        eng.step()
    print("the first joining requests' steps (first use of their shapes):",
          [round(s.step_s * 1e3, 2) for s in list(eng.step_history)[-4:]], "ms", flush=True)
    for j, p in enumerate(prefixes):
        eng.add_request(f"joining{j}", p + torch.randint(10, 1000, (a.prefill,), generator=g).tolist(), greedy)
    n_steps = 2                                # the mixed step (and, async, the one that collects it)
compiles = CompileLog().install() if a.device == "cuda" else None     # Triton JIT inside the profiled steps
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
with profile(activities=acts) as prof:
    for _ in range(n_steps):
        eng.step()
    if a.device == "cuda":
        torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=a.rows))
if a.device == "cuda":
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=a.rows))
    launches = sum(e.count for e in prof.key_averages() if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                     "cudaLaunchKernelExC", "cuLaunchKernelEx"))
    print(f"kernel launches in {n_steps} steps: {launches}")
if compiles is not None:
    compiles.uninstall()
    print(f"Triton compiles in the profiled steps: {len(compiles.compiles)}")
    print(compiles.summary())
print("steps:", [round(s.step_s * 1e3, 2) for s in list(eng.step_history)[-n_steps:]], "ms")
for s in list(eng.step_history)[-n_steps:]:    # the host's share of each profiled step
    print(f"  step of {s.num_tokens} tokens ({s.num_prefill_tokens} prompt): wall {1e3 * s.step_s:.2f} ms = schedule "
          f"{1e3 * s.schedule_s:.2f} + execute {1e3 * s.execute_s:.2f} + update {1e3 * s.update_s:.2f} (host calls)")
if a.cprofile and a.prefill:                   # the host's Python time of the same kind of step, by function
    import cProfile  # noqa: PLC0415
    import pstats  # noqa: PLC0415
    for _ in range(4):                         # the joining request's first decodes; the batch still decodes
        eng.step()
    for j, p in enumerate(prefixes):
        eng.add_request(f"again{j}", p + torch.randint(10, 1000, (a.prefill,), generator=g).tolist(), greedy)
    prof_py = cProfile.Profile()
    prof_py.enable()
    for _ in range(n_steps):
        eng.step()
    if a.device == "cuda":
        torch.cuda.synchronize()
    prof_py.disable()
    print("cProfile steps:", [round(s.step_s * 1e3, 2) for s in list(eng.step_history)[-n_steps:]], "ms")
    st = pstats.Stats(prof_py)
    st.sort_stats("tottime").print_stats(a.cprofile)
    st.sort_stats("cumulative").print_stats(a.cprofile)

