"""Kernel-launching aten ops (views and no-op casts excluded) in one decode forward of the tiny model,
bf16, batch 8, counted on the CPU with a TorchDispatchMode: a device-free proxy for the launch count
that bounds a host-bound GPU decode step.

    python tools/count_launches.py
"""
import collections, sys
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from glm_ray import LLM, SamplingParams
VIEWS = {"view", "slice", "unsqueeze", "transpose", "select", "alias", "detach", "detach_", "lift_fresh", "expand", "_unsafe_view", "reshape", "t", "permute", "split", "chunk", "unbind", "squeeze", "as_strided", "item", "_local_scalar_dense", "split_with_sizes"}
class Count(TorchDispatchMode):
    def __init__(self): super().__init__(); self.c = collections.Counter()
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        n = str(func.overloadpacket.__name__)
        # a no-op .to (same dtype/device) returns its input: no kernel
        if n in VIEWS or (n in ("to", "_to_copy") and out is (args[0] if args else None)): return out
        self.c[n] += 1
        return out
llm = LLM(None, dtype="bfloat16", kv_cache_memory_bytes=256 << 20)
eng = llm.engine; g = torch.Generator().manual_seed(0)
for i in range(8):
    eng.add_request(str(i), torch.randint(10, 1000, (40,), generator=g).tolist(), SamplingParams(max_tokens=64, ignore_eos=True, temperature=0))
for _ in range(4): eng.step()
c = Count()
net = eng.executor.worker.model
orig = net.forward
def fwd(*a, **k):
    with c: return orig(*a, **k)
net.forward = fwd
eng.step()
print("launching ops in one decode forward:", sum(c.c.values()), dict(c.c.most_common(12)))
