"""Host cost of one Scheduler.schedule() with W waiting requests (2176-token prompts, 32 groups, half cached) and
64 running decodes, fcfs vs lpm, block size 64, budget 2048. Prints median us per schedule()."""
import random, statistics, time
from glm_ray.config import SchedulerConfig
from glm_ray.engine.kv_cache import KVCacheManager
from glm_ray.engine.request import Request
from glm_ray.engine.sampling_params import SamplingParams
from glm_ray.engine.scheduler import Scheduler

def build(policy, W):
    kv = KVCacheManager(40000, 64, enable_prefix_caching=True)
    s = Scheduler(SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=2048, policy=policy), kv)
    rng = random.Random(0)
    prefixes = [[rng.randrange(1000, 100000) for _ in range(2048)] for _ in range(32)]
    for g in range(16):                      # cache half the groups' prefixes
        r = Request(f"w{g}", prefixes[g] + [1] * 128, SamplingParams(max_tokens=1), max_tokens=1)
        kv.admit(r, kv.match(r)); kv.allocate(r, r.num_tokens); r.num_computed_tokens = r.num_tokens
        kv.register(r, r.num_tokens); kv.free(r)
    reqs = [Request(f"q{i}", prefixes[rng.randrange(32)] + [rng.randrange(1000, 100000) for _ in range(128)],
                    SamplingParams(max_tokens=8), max_tokens=8) for i in range(W)]
    return s, reqs

for W in (16, 64, 128):
    for policy in ("fcfs", "lpm"):
        ts = []
        for rep in range(7):
            s, reqs = build(policy, W)
            s.cfg = SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=0 + 2048, policy=policy)
            for r in reqs:
                s.add(r)
            s.cfg = SchedulerConfig(max_num_seqs=0, max_num_batched_tokens=2048, policy=policy)   # admit nothing:
            t0 = time.perf_counter(); s.schedule(); ts.append(time.perf_counter() - t0)          # the ordering + loop head only
        print(f"W={W:4d} {policy}: {1e6 * statistics.median(ts):8.0f} us per schedule() (nothing admitted)")
