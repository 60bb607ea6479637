"""Prefix caching on the GPU engine (skipped without a CUDA/ROCm device): the CPU tests check the cache's rules and
that its outputs equal the cache-off engine's; this checks the same on the GPU path a served step takes (async
scheduling, decode graphs, piecewise prefill graphs, pinned staging, the block tables a cached prefix shares).
fp32 with TF32 off, so the two runs differ only in reduction order (a cached prompt computes only its tail, in
a batch of another shape): the same greedy tokens, logprobs within 1e-3 — the bound test_gpu_engine holds the GPU
to against the CPU. (bf16 dummy weights give near-flat logits whose argmax flips with the batch shape: no
bf16 token comparison is meaningful there.)"""
from __future__ import annotations

import pytest
import torch

from glm_ray import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU present")]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    system = torch.randint(10, 1000, (96,), generator=g).tolist()          # six 16-token blocks, past index_topk
    return [system + torch.randint(10, 1000, (n,), generator=g).tolist() for n in (5, 21, 40, 9, 64, 13)]


def _run(path, cache: bool) -> list[tuple[list[int], list[float]]]:
    llm = LLM(path, device="cuda", dtype="float32", enable_prefix_caching=cache, kv_cache_memory_bytes=256 << 20)
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    prompts = _prompts()
    llm.generate([{"prompt_token_ids": prompts[0]}], sp, use_tqdm=False)   # fills the cache with the system prompt
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)   # all at once: all hit
    kv = llm.engine.kv
    assert (kv.prefix_hits > 0) == cache
    return [(o.outputs[0].token_ids, [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def test_gpu_outputs_equal_with_the_cache_on_and_off(oracle_dir):
    torch.backends.cuda.matmul.allow_tf32 = False
    off, on = _run(oracle_dir, False), _run(oracle_dir, True)
    for (ta, la), (tb, lb) in zip(off, on):
        assert ta == tb
        assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-3
