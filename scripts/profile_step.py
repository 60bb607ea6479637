"""Profile a few decode steps of the engine (torch.profiler), print the top ops by device and host time.

    python scripts/profile_step.py MODEL --device cuda --dtype bfloat16 --batch 8
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from glm_ray import LLM, SamplingParams

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("--device", default="cuda")
p.add_argument("--dtype", default="bfloat16")
p.add_argument("--batch", type=int, default=8)
p.add_argument("--load-format", default="auto")
p.add_argument("--rows", type=int, default=25)
a = p.parse_args()
llm = LLM(a.model, device=a.device, dtype=a.dtype, kv_cache_memory_bytes=1 << 30, max_num_seqs=a.batch,
          load_format=a.load_format)
eng = llm.engine
g = torch.Generator().manual_seed(0)
for i in range(a.batch):
    eng.add_request(str(i), torch.randint(10, 1000, (32,), generator=g).tolist(),
                    SamplingParams(max_tokens=64, ignore_eos=True, temperature=0))
for _ in range(8):
    eng.step()
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
with profile(activities=acts) as prof:
    for _ in range(5):
        eng.step()
    if a.device == "cuda":
        torch.cuda.synchronize()
key = "cuda_time_total" if a.device == "cuda" else "cpu_time_total"
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=a.rows))
if a.device == "cuda":
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=a.rows))
print("steps:", [round(s.step_s * 1e3, 2) for s in list(eng.step_history)[-5:]], "ms")
