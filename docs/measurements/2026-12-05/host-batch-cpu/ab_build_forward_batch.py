"""A/B in one process, interleaved: build_forward_batch at HEAD~ (torch ops, one pageable copy per field)
vs now (numpy + one staged copy), CPU host time per call."""
import sys, time, importlib.util, torch
sys.path.insert(0, "/tmp/ab")
import fb_old
from glm_ray.forward_batch import build_forward_batch as new, contiguous_block_tables
torch.set_num_threads(1)
cases = {"prefill 8x1024": ([1024]*8, [1024]*8), "prefill 1x8192": ([8192], [8192]),
         "mixed 12 dec + 1x2048 tail after 2048": ([1]*12 + [128], [1500]*12 + [2176]),
         "decode 64 @1k": ([1]*64, [1024]*64), "decode 1 @1k": ([1], [1024])}
for name, (ql, cl) in cases.items():
    bt = contiguous_block_tables(cl, 64)
    res = {"old": [], "new": []}
    for rep in range(7):
        for tag, f in (("old", fb_old.build_forward_batch), ("new", new)):
            t = time.perf_counter()
            for _ in range(50):
                f(ql, cl, bt, 64, torch.device("cpu"))
            res[tag].append((time.perf_counter() - t) / 50 * 1e3)
    o, n = sorted(res["old"])[3], sorted(res["new"])[3]
    print(f"{name:40s} old {o:.3f} ms  new {n:.3f} ms  {o/n:.2f}x")
