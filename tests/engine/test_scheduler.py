"""Scheduler policy on the host only (no model): token budget, chunking, decode-first, preemption."""
from __future__ import annotations

from glm_ray.config import SchedulerConfig
from glm_ray.engine.kv_cache import KVCacheManager
from glm_ray.engine.request import Request
from glm_ray.engine.sampling_params import SamplingParams
from glm_ray.engine.scheduler import Scheduler


def _req(rid, n, max_tokens=8):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)


def _advance(sched, out, sampled=7):
    """What the engine does after a step: count computed tokens, append one sampled token."""
    for s in out.seqs:
        r = next(x for x in sched.running if x.request_id == s.req_id)
        r.num_computed_tokens += len(s.token_ids)
        if s.sample:
            r.output_token_ids.append(sampled)


def test_budget_chunking_and_mixed_steps():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10), KVCacheManager(100, 4))
    sched.add(_req("a", 3))
    out = sched.schedule()
    assert [(s.req_id, len(s.token_ids), s.sample) for s in out.seqs] == [("a", 3, True)]
    _advance(sched, out)
    sched.add(_req("b", 25))
    out = sched.schedule()                          # a decodes (1) + b's first chunk (9)
    assert [(s.req_id, len(s.token_ids), s.sample) for s in out.seqs] == [("a", 1, True), ("b", 9, False)]
    assert out.num_tokens <= 10 and [n.req_id for n in out.new_requests] == ["b"]
    _advance(sched, out)
    out = sched.schedule()
    assert [(s.req_id, s.start_pos, len(s.token_ids)) for s in out.seqs] == [("a", 4, 1), ("b", 9, 9)]


def test_preemption_recomputes_latest_and_loses_nothing():
    kv = KVCacheManager(4, 4)                       # 16 token slots
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv)
    for rid in ("a", "b"):
        sched.add(_req(rid, 7, max_tokens=20))
    out = sched.schedule()
    assert len(out.seqs) == 2                       # 2 blocks each
    _advance(sched, out)
    _advance(sched, sched.schedule())               # 9 tokens each now -> needs a 3rd block each
    out = sched.schedule()
    assert out.num_preempted == 1
    assert [s.req_id for s in out.seqs] == ["a"] and sched.waiting[0].request_id == "b"
    b = sched.waiting[0]
    assert b.num_computed_tokens == 0 and b.block_ids == [] and len(b.output_token_ids) == 2
    # once a finishes, b is recomputed from prompt + its outputs, with its full block table
    sched.finish(sched.running[0], "stop")
    out = sched.schedule()
    assert out.seqs[0].req_id == "b" and out.seqs[0].reset_blocks
    assert out.seqs[0].token_ids == list(range(1, 8)) + [7, 7] and out.seqs[0].sample


def test_too_long_prompt_rejected(tiny_dir):
    import pytest

    from glm_ray import LLM
    from glm_ray.engine.errors import InvalidRequestError
    llm = LLM(tiny_dir, dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="context length 64"):
        llm.engine.add_request("x", list(range(1, 60)), SamplingParams(max_tokens=10))
    with pytest.raises(InvalidRequestError, match="context length"):
        llm.engine.add_request("y", list(range(1, 70)), SamplingParams(max_tokens=1))
