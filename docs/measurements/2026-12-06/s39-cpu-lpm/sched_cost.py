"""Host cost of the waiting queue's ordering in one `Scheduler.schedule()`: W waiting 2,176-token prompts (32 groups,
16 of them with a cached 2,048-token prefix), block size 64, fcfs vs lpm. Nothing is admitted (max_num_seqs 0), so
the time is the ordering and the loop's head alone. Prints the median of 7 builds per (W, policy).

    PYTHONPATH=. python docs/measurements/2026-12-06/s39-cpu-lpm/sched_cost.py
"""
import random
import statistics
import time

from glm_ray.config import SchedulerConfig
from glm_ray.engine.kv_cache import KVCacheManager
from glm_ray.engine.request import Request
from glm_ray.engine.sampling_params import SamplingParams
from glm_ray.engine.scheduler import Scheduler


def build(policy: str, waiting: int) -> Scheduler:
    kv = KVCacheManager(40000, 64, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=0, max_num_batched_tokens=2048, policy=policy), kv)
    rng = random.Random(0)
    prefixes = [[rng.randrange(1000, 100000) for _ in range(2048)] for _ in range(32)]
    for g in range(16):                                   # cache half the groups' prefixes
        r = Request(f"w{g}", prefixes[g] + [1] * 128, SamplingParams(max_tokens=1), max_tokens=1)
        kv.admit(r, kv.match(r))
        kv.allocate(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens
        kv.register(r, r.num_tokens)
        kv.free(r)
    for i in range(waiting):
        ids = prefixes[rng.randrange(32)] + [rng.randrange(1000, 100000) for _ in range(128)]
        sched.add(Request(f"q{i}", ids, SamplingParams(max_tokens=8), max_tokens=8))
    return sched


for w in (16, 64, 128):
    for policy in ("fcfs", "lpm"):
        ts = []
        for _ in range(7):
            sched = build(policy, w)
            t0 = time.perf_counter()
            sched.schedule()
            ts.append(time.perf_counter() - t0)
        print(f"W={w:4d} {policy}: {1e6 * statistics.median(ts):8.0f} us per schedule() (nothing admitted)")
