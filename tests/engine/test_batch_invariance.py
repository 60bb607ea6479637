"""The same request gives the same greedy tokens alone, batched with requests of other lengths, with
chunked prefill, and after preemption (recompute). fp32 on CPU; greedy."""
from __future__ import annotations

import torch

from glm_ray import LLM, SamplingParams

SP = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _ids(n, seed):
    return torch.randint(10, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _gen(path, prompts, **kw):
    kw.setdefault("kv_cache_memory_bytes", 32 << 20)
    llm = LLM(path, dtype="float32", **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SP, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def test_alone_batched_chunked_preempted(oracle_dir):
    target = _ids(37, 0)
    others = [_ids(n, 10 + n) for n in (3, 11, 64, 25, 50, 9)]
    alone, _ = _gen(oracle_dir, [target])
    batched, _ = _gen(oracle_dir, others[:3] + [target] + others[3:])
    chunked, _ = _gen(oracle_dir, others[:2] + [target], max_num_batched_tokens=13)
    # ~ 11 blocks of 16 tokens for 7 requests growing to 60-90 tokens each: preemption must happen
    from glm_ray.config import ModelConfig
    from glm_ray.worker.cache import kv_bytes_per_token
    per_tok = kv_bytes_per_token(ModelConfig.from_pretrained(oracle_dir, "float32"), torch.float32)
    preempted, llm = _gen(oracle_dir, others + [target], kv_cache_memory_bytes=per_tok * 16 * 11)
    assert llm.engine.num_preemptions > 0, "the small KV budget was meant to force preemption"
    assert batched[3] == alone[0]
    assert chunked[2] == alone[0]
    assert preempted[-1] == alone[0]
    # and every other request survived preemption with its full output
    ref_others, _ = _gen(oracle_dir, others)
    assert preempted[:-1] == ref_others
