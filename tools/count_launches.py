"""Kernel-launching aten ops (views and no-op casts excluded) in one decode forward of the tiny model,
bf16, batch 8, counted on the CPU with a TorchDispatchMode: a device-free proxy for the launch count
that bounds a host-bound GPU decode step. `--by-module` splits the count by the innermost module
(layer indices folded to N), which is where a launch cut has to happen.

    python tools/count_launches.py [--by-module] [--model DIR]   # e.g. a `make-tiny --config glm53-flash-tiny-text.json` dir
"""
import argparse
import collections
import re

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from glm_ray import LLM, SamplingParams

VIEWS = {"view", "slice", "unsqueeze", "transpose", "select", "alias", "detach", "detach_", "lift_fresh", "expand", "_unsafe_view", "reshape", "t", "permute", "split", "chunk", "unbind", "squeeze", "as_strided", "item", "_local_scalar_dense", "split_with_sizes"}
class Count(TorchDispatchMode):
    def __init__(self, where): super().__init__(); self.c = collections.Counter(); self.where = where
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        n = str(func.overloadpacket.__name__)
        # a no-op .to (same dtype/device) returns its input: no kernel
        if n in VIEWS or (n in ("to", "_to_copy") and out is (args[0] if args else None)): return out
        self.c[(self.where[-1], n)] += 1
        return out
a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
a.add_argument("--by-module", action="store_true")
a.add_argument("--model", default=None, help="checkpoint directory (default: the cached tiny GLM-5)")
a = a.parse_args()
llm = LLM(a.model, dtype="bfloat16", kv_cache_memory_bytes=256 << 20)
eng = llm.engine; g = torch.Generator().manual_seed(0)
for i in range(8):
    eng.add_request(str(i), torch.randint(10, 1000, (40,), generator=g).tolist(), SamplingParams(max_tokens=64, ignore_eos=True, temperature=0))
for _ in range(4): eng.step()
net = eng.executor.worker.model
where = ["model"]
if a.by_module:
    for name, mod in net.named_modules():
        mod.register_forward_pre_hook(lambda m, args, s=re.sub(r"layers\.\d+\.", "layers.N.", name): where.append(s))
        mod.register_forward_hook(lambda m, args, out: (where.pop(), None)[1])
c = Count(where)
orig = net.forward
def fwd(*args, **kw):
    with c: return orig(*args, **kw)
net.forward = fwd
eng.step()
ops = collections.Counter()
for (_, n), v in c.c.items(): ops[n] += v
print(f"launching ops in one decode forward ({eng.model_cfg.num_hidden_layers} layers):", sum(ops.values()),
      dict(ops.most_common(12)))
if a.by_module:
    mods = collections.Counter()
    for (m, _), v in c.c.items(): mods[m] += v
    for m, v in mods.most_common(15):
        top = ", ".join(f"{n} {k}" for (mm, n), k in c.c.most_common() if mm == m)[:110]
        print(f"{v:5d}  {m:45s} {top}")
