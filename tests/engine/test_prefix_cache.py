"""Automatic prefix caching (engine/kv_cache.py): the block pool's rules on the host, then the engine's
outputs with the cache on == off (greedy, seeded, logprobs, n > 1 sharing a prompt, chunked prefill,
preemption, async scheduling), a cached prefix computing only its tail, and eviction under pressure
losing no request. fp32 on CPU; the oracle is the same engine with the cache off (itself checked
against transformers elsewhere)."""
from __future__ import annotations

import pytest
import torch

from glm_ray import LLM, SamplingParams
from glm_ray.config import SchedulerConfig
from glm_ray.engine.kv_cache import KVCacheManager
from glm_ray.engine.request import Request
from glm_ray.engine.scheduler import Scheduler


def _req(rid, tokens, **kw):
    return Request(rid, list(tokens), SamplingParams(max_tokens=8, **kw), max_tokens=8)


def _compute(kv, req, upto=None):
    """What a finished step does: hold blocks for the tokens, then register the full ones."""
    n = req.num_tokens if upto is None else upto
    kv.allocate(req, n)
    req.num_computed_tokens = n
    kv.register(req, n)


# ---- the block pool ---------------------------------------------------------------------------------
def test_match_takes_whole_blocks_and_leaves_the_last_token():
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    a = _req("a", range(1, 13))                           # 12 tokens = 3 full blocks
    kv.admit(a, kv.match(a))
    _compute(kv, a)
    assert kv.num_cached_blocks == 3
    kv.free(a)
    b = _req("b", range(1, 13))                           # the same 12 tokens: 2 blocks (the last token is computed)
    hit = kv.match(b)
    assert hit == a_blocks(kv, 2) and len(hit) == 2
    c = _req("c", list(range(1, 11)) + [99, 98, 97])      # 10 shared tokens: 2 blocks
    assert len(kv.match(c)) == 2
    d = _req("d", [5] + list(range(2, 13)))               # differs in token 0: nothing
    assert kv.match(d) == []
    e = _req("e", range(1, 13), prompt_logprobs=1)        # prompt logprobs need every position's logits
    assert kv.match(e) == []


def a_blocks(kv, n):
    """The first n registered blocks of the chain that starts at parent -1 (for asserting identities)."""
    out, parent = [], -1
    for _ in range(n):
        b = next(b for k, b in kv._cached.items() if k[0] == parent)
        out.append(b)
        parent = b
    return out


def test_same_tokens_under_another_prefix_is_another_key():
    """The key is (parent block, tokens): block 2 of two prompts with equal second blocks but different
    first blocks never matches across them."""
    kv = KVCacheManager(16, 2, enable_prefix_caching=True)
    a = _req("a", [1, 2, 7, 7, 9])
    kv.admit(a, [])
    _compute(kv, a)
    kv.free(a)
    b = _req("b", [3, 4, 7, 7, 9])
    assert kv.match(b) == []
    kv.admit(b, [])
    _compute(kv, b)
    assert kv.num_cached_blocks == 4


def test_referenced_blocks_are_never_handed_out_and_lru_evicts_tails_first():
    kv = KVCacheManager(4, 2, enable_prefix_caching=True)
    a = _req("a", [1, 2, 3, 4, 5, 6, 7])                  # 4 blocks (the whole pool), 3 full
    kv.admit(a, [])
    _compute(kv, a)
    held = list(a.block_ids)
    kv.free(a)
    assert kv.num_free == 4 and kv.num_cached_blocks == 3
    b = _req("b", [1, 2, 3, 4, 9, 9, 9])                  # shares 2 blocks with a
    hit = kv.match(b)
    assert hit == held[:2]
    assert kv.can_admit(hit, 8) and not kv.can_admit(hit, 9)    # the hit blocks leave the free queue too
    kv.admit(b, hit)
    new = kv.allocate(b, 7)
    # handed out first: a's unregistered partial block, then its registered tail (evicted for b)
    assert new == [held[3], held[2]]
    assert kv.num_cached_blocks == 2
    c = _req("c", [1, 2, 3, 4, 5, 6, 0])
    assert kv.match(c) == hit                             # b holds them: still cached, still shared
    with pytest.raises(RuntimeError):
        kv.allocate(_req("x", [1]), 1)                    # nothing free, and b's blocks are never taken


def test_evicting_a_block_evicts_its_descendants():
    kv = KVCacheManager(4, 2, enable_prefix_caching=True)
    a = _req("a", [1, 2, 3, 4, 5, 6, 7])                  # blocks 0-2 registered, chained
    kv.admit(a, [])
    _compute(kv, a)
    root = a.block_ids[0]
    kv.free(a)
    kv._free.move_to_end(root, last=False)                # force the chain's root out first
    x = _req("x", [9])
    kv.admit(x, [])
    assert kv.allocate(x, 1) == [root]
    assert kv.num_cached_blocks == 0                      # its children went with it
    assert kv.match(_req("y", [1, 2, 3, 4, 5, 6, 7])) == []


def test_a_duplicate_block_stops_the_chain():
    """Two requests with one prompt admitted in the same step compute the same blocks; the second's copies
    are not registered (and nothing under them)."""
    kv = KVCacheManager(16, 2, enable_prefix_caching=True)
    a, b = _req("a", [1, 2, 3, 4, 5]), _req("b", [1, 2, 3, 4, 5])
    for r in (a, b):
        kv.admit(r, kv.match(r))
        kv.allocate(r, 5)
    kv.register(a, 5)
    kv.register(b, 5)
    assert kv.num_cached_blocks == 2 and b.num_registered_blocks == -1
    assert kv.match(_req("c", [1, 2, 3, 4, 5])) == a.block_ids[:2]


def test_cache_off_matches_nothing():
    kv = KVCacheManager(8, 2)
    a = _req("a", [1, 2, 3, 4, 5])
    kv.admit(a, kv.match(a))
    _compute(kv, a)
    kv.free(a)
    assert kv.match(_req("b", [1, 2, 3, 4, 5])) == [] and kv.num_cached_blocks == 0


def test_reset_forgets_the_unheld_blocks_only():
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    a, b = _req("a", range(1, 13)), _req("b", range(50, 62))
    for r in (a, b):
        kv.admit(r, kv.match(r))
        _compute(kv, r)
    a_ids = list(a.block_ids)
    kv.free(a)                                            # a's 3 blocks: cached, unheld; b's: held
    assert kv.num_cached_blocks == 6
    assert kv.reset_prefix_cache() == 3
    assert kv.num_cached_blocks == 3 and kv.match(_req("a2", range(1, 13))) == []
    assert len(kv.match(_req("b2", range(50, 62)))) == 2   # b's chain stays
    assert set(list(kv._free)[:3]) == set(a_ids)           # forgotten blocks go out first
    kv.free(b)
    assert kv.num_free == 16 and kv.reset_prefix_cache() == 3 and kv.num_cached_blocks == 0


def test_scheduler_computes_only_the_uncached_tail():
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv)
    a = _req("a", range(1, 31))                           # 30 tokens: 7 full blocks
    sched.add(a)
    out = sched.schedule()
    assert out.seqs[0].start_pos == 0 and len(out.seqs[0].token_ids) == 30
    a.num_computed_tokens = 30
    kv.register(a, 30)
    sched.finish(a, "stop")
    b = _req("b", list(range(1, 27)) + [500, 501, 502])   # shares 26 tokens = 6 full blocks
    sched.add(b)
    out = sched.schedule()
    s = out.seqs[0]
    assert (s.start_pos, len(s.token_ids), s.reset_blocks) == (24, 5, True)
    assert s.token_ids == b.prompt_token_ids[24:] and len(s.block_ids) == 8
    assert s.block_ids[:6] == a_blocks(kv, 6)
    assert b.num_cached_tokens == 24 and (kv.prefix_queries, kv.prefix_hits) == (30 + 29, 24)


def _step(kv, sched, out):
    """What the engine does with a step's results (sync scheduling): progress, one sampled token, and the
    filled blocks registered."""
    for s in out.seqs:
        r = next(x for x in sched.running if x.request_id == s.req_id)
        r.num_computed_tokens = s.start_pos + len(s.token_ids)
        if s.sample:
            r.output_token_ids.append(7)
        kv.register(r, r.num_computed_tokens)


def _scheduled(out):
    return [(s.req_id, s.start_pos, len(s.token_ids)) for s in out.seqs]


def test_a_prefix_being_computed_is_waited_for_not_computed_twice():
    """sglang's in-batch prefix caching: b shares a's 3 uncached blocks, so b waits while a computes them
    and c (another prefix, behind b) goes first; once a's chunk is in the cache b computes its tail only."""
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv)
    head = list(range(1, 13))                             # 12 tokens = 3 blocks
    a, b, c = _req("a", head + [50, 51]), _req("b", head + [60, 61, 62]), _req("c", range(100, 114))
    for r in (a, b, c):
        sched.add(r)
    out = sched.schedule()
    assert _scheduled(out) == [("a", 0, 14), ("c", 0, 14)] and [r.request_id for r in sched.waiting] == ["b"]
    _step(kv, sched, out)
    out = sched.schedule()
    assert _scheduled(out) == [("a", 14, 1), ("c", 14, 1), ("b", 12, 3)]
    assert out.seqs[2].block_ids[:3] == a.block_ids[:3] and b.num_cached_tokens == 12


def test_the_wait_ends_when_the_computing_request_leaves():
    """Finished (or aborted) before its blocks reached the cache: the waiting request computes them itself.
    Preempted requests, prompts shorter than a block past the cached prefix and the cache off never wait."""
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv)
    a, b = _req("a", range(1, 15)), _req("b", list(range(1, 13)) + [9, 9])
    sched.add(a)
    sched.add(b)
    assert _scheduled(sched.schedule()) == [("a", 0, 14)]
    sched.finish(a, "abort")
    assert _scheduled(sched.schedule()) == [("b", 0, 14)]
    short = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                      KVCacheManager(64, 4, enable_prefix_caching=True))
    for r in (_req("x", range(1, 5)), _req("y", range(1, 5))):      # 4 tokens: no whole block before the last
        short.add(r)
    assert len(short.schedule().seqs) == 2
    off = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), KVCacheManager(64, 4))
    for r in (_req("a", range(1, 15)), _req("b", range(1, 15))):
        off.add(r)
    assert len(off.schedule().seqs) == 2
    pre = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                    KVCacheManager(64, 4, enable_prefix_caching=True))
    a, b = _req("a", range(1, 15)), _req("b", range(1, 15))
    b.num_preemptions = 1
    pre.add(a)
    pre.add(b)
    assert len(pre.schedule().seqs) == 2


def test_lpm_takes_cache_hits_first_and_the_rest_chunks_into_what_is_left():
    """sglang's lpm: c (its 3 blocks cached) and d (2 blocks) go before b (nothing cached) that came first;
    b still takes the budget they leave. A preempted request keeps the head; fcfs keeps arrival order."""
    def run(policy, preempt_b=False):
        kv = KVCacheManager(64, 4, enable_prefix_caching=True)
        sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, policy=policy), kv)
        a = _req("a", range(1, 14))
        sched.add(a)
        _step(kv, sched, sched.schedule())                # a: 13 tokens computed, 3 blocks cached
        b = _req("b", range(100, 120))                    # 20 uncached tokens
        b.num_preemptions = int(preempt_b)
        c, d = _req("c", list(range(1, 13)) + [70, 71]), _req("d", list(range(1, 9)) + [80, 81, 82])
        for r in (b, c, d):
            sched.add(r)
        return _scheduled(sched.schedule())
    assert run("lpm") == [("a", 13, 1), ("c", 12, 2), ("d", 8, 3), ("b", 0, 10)]
    assert run("fcfs") == [("a", 13, 1), ("b", 0, 15)]
    assert run("lpm", preempt_b=True) == [("a", 13, 1), ("b", 0, 15)]


def test_a_schedule_policy_is_fcfs_or_lpm():
    with pytest.raises(ValueError, match="schedule policy"):
        SchedulerConfig(policy="sjf")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_burst_sharing_a_new_prefix_computes_it_once(tiny_dir, async_scheduling):
    """Six prompts with one new 53-token system prompt sent together: the prefix's whole blocks are computed
    once (the rest wait for them), every output equals the cache-off run's."""
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)] * 4 + [
        SamplingParams(max_tokens=6, temperature=0.8, seed=5, ignore_eos=True)] * 2
    prompts = [SYSTEM + _ids(n, 70 + n) for n in (4, 17, 9, 30, 12, 21)]
    outs, prefill = [], []
    for cache in (False, True):
        llm = LLM(tiny_dir, dtype="float32", enable_prefix_caching=cache, kv_cache_memory_bytes=32 << 20,
                  async_scheduling=async_scheduling)
        outs.append(_generate(llm, prompts, params))
        prefill.append(sum(s.num_prefill_tokens for s in llm.engine.step_history))
    _assert_same(outs[1], outs[0])
    shared = len(SYSTEM) // 16 * 16                       # whole 16-token blocks of the system prompt
    assert prefill[0] == sum(len(p) for p in prompts)
    assert prefill[1] == shared + sum(len(p) - shared for p in prompts)


# ---- the engine: cache on == cache off -------------------------------------------------------------
def _ids(n, seed):
    return torch.randint(10, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM = _ids(53, 1)                                      # a shared 53-token "system prompt"
PROMPTS = [SYSTEM + _ids(n, 10 + n) for n in (4, 17, 9, 30)] + [SYSTEM[:20] + _ids(12, 5), _ids(40, 6)]


def _params():
    return [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2),
            SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
            SamplingParams(max_tokens=8, temperature=0.8, top_k=20, seed=3, n=3, ignore_eos=True),
            SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, prompt_logprobs=1),
            SamplingParams(max_tokens=7, temperature=0.7, seed=11, ignore_eos=True)]


def _generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, c.logprobs) for c in o.outputs] + [o.prompt_logprobs] for o in outs]


def _assert_same(a, b, tol=1e-4):
    """Tokens and finish reasons exactly; logprobs (same ids) within `tol`: a prompt computed after a
    cached prefix runs through the chunked-prefill attention, whose fp32 sums differ in the last bits."""
    def lps(x, y):
        for u, v in zip(x or [], y or []):
            if u is None or v is None:
                assert u is v
                continue
            assert u.keys() == v.keys() and max(abs(u[t] - v[t]) for t in u) < tol
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert len(ra) == len(rb)
        for (ta, fa, la), (tb, fb, lb) in zip(ra[:-1], rb[:-1]):
            assert (ta, fa) == (tb, fb)
            assert (la is None) == (lb is None)
            lps(la, lb)
        assert (ra[-1] is None) == (rb[-1] is None)
        lps(ra[-1], rb[-1])


def _served_twice(path, cache: bool, **kw):
    """The prompts twice: a warm-up pass that fills the cache, then one that hits it."""
    kw.setdefault("kv_cache_memory_bytes", 32 << 20)
    llm = LLM(path, dtype="float32", enable_prefix_caching=cache, **kw)
    first = [_generate(llm, [p], [sp])[0] for p, sp in zip(PROMPTS, _params())]   # one at a time: later ones hit
    second = _generate(llm, PROMPTS, _params())                                      # all at once, all cached
    return first, second, llm


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 16}, {"async_scheduling": True},
                                {"schedule_policy": "lpm", "max_num_batched_tokens": 16}],
                         ids=["default", "chunked", "async", "lpm"])
def test_outputs_equal_with_the_cache_on_and_off(tiny_dir, kw):
    """The default tiny model (16 indexer heads: with 4, ReLU made many index scores exactly 0 and their
    top-k ties broke differently with the batch shape, which prefix caching changes)."""
    off = _served_twice(tiny_dir, False, **kw)
    on = _served_twice(tiny_dir, True, **kw)
    _assert_same(on[0], off[0])
    _assert_same(on[1], off[1])
    _assert_same(off[0], off[1])                           # the oracle itself agrees across batchings
    kv = on[2].engine.kv
    assert kv.prefix_hits > 0 and off[2].engine.kv.prefix_hits == 0
    assert kv.usage() == 0.0 and on[2].engine.scheduler.num_unfinished == 0


def test_outputs_equal_with_absorbed_tails(tiny_dir, monkeypatch):
    """As above with cached tails and later chunks attending as one-query decode rows (the cuda backend's
    default, GLM_RAY_ABSORB_PREFILL_TOKENS; the torch backend keeps them naive)."""
    monkeypatch.setenv("GLM_RAY_ABSORB_PREFILL_TOKENS", "256")
    off = _served_twice(tiny_dir, False, max_num_batched_tokens=16)
    on = _served_twice(tiny_dir, True, max_num_batched_tokens=16)
    assert on[2].engine.executor.worker.runner.absorb_tokens == 256
    _assert_same(on[0], off[0])
    _assert_same(on[1], off[1])


def test_a_cached_prefix_computes_only_its_tail(oracle_dir):
    llm = LLM(oracle_dir, dtype="float32", kv_cache_memory_bytes=32 << 20)
    sp = SamplingParams(max_tokens=1, temperature=0)
    _generate(llm, [PROMPTS[0]], [sp])
    llm.engine.step_history.clear()
    _generate(llm, [PROMPTS[1]], [sp])
    prefill = sum(s.num_prefill_tokens for s in llm.engine.step_history)
    cached = (len(SYSTEM) // 16) * 16                      # whole 16-token blocks of the shared prefix
    assert prefill == len(PROMPTS[1]) - cached
    # a prompt entirely cached still computes its last block (the logits of its last token)
    llm.engine.step_history.clear()
    _generate(llm, [PROMPTS[1]], [sp])
    assert sum(s.num_prefill_tokens for s in llm.engine.step_history) == len(PROMPTS[1]) - (len(PROMPTS[1]) - 1) // 16 * 16


def test_eviction_under_pressure_loses_no_request(oracle_dir):
    """A pool of 12 blocks, 12 prompts of ~3 blocks each with shared heads, 3 at a time: blocks are
    evicted and preempted requests recompute, and every output equals the cache-off run."""
    from glm_ray.config import ModelConfig
    from glm_ray.worker.cache import kv_bytes_per_token
    per_tok = kv_bytes_per_token(ModelConfig.from_pretrained(oracle_dir, "float32"), torch.float32)
    prompts = [_ids(16, i % 3) + _ids(20 + i, 50 + i) for i in range(12)]
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)] * len(prompts)
    outs = []
    for cache in (False, True):
        llm = LLM(oracle_dir, dtype="float32", enable_prefix_caching=cache, kv_cache_memory_bytes=per_tok * 16 * 12,
                  max_num_seqs=3)
        outs.append(_generate(llm, prompts, params))
        assert llm.engine.kv.num_blocks == 12
    _assert_same(outs[0], outs[1])
    assert all(len(o[0][0]) == 10 for o in outs[1])
    assert llm.engine.kv.prefix_hits > 0


def test_hybrid_models_keep_the_cache_off(tmp_path, caplog):
    import logging

    from glm_ray.model.tiny import bundled_config, write_tiny
    path = write_tiny(tmp_path / "flash", bundled_config("glm53-flash-tiny-text.json"), dtype=torch.float32)
    with caplog.at_level(logging.INFO, logger="glm_ray"):
        llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=16 << 20)
    assert not llm.engine.kv.enable_prefix_caching
    assert "prefix caching is off" in caplog.text
