"""A step's host -> device copies all come from pinned memory (glm_ray/staging.py): the batch metadata, the
token ids, the sampler's per-row parameters, an async step's placeholder picks and the decode graphs' static
inputs, a penalized request's history. A pageable copy (a `torch.tensor(list).to(cuda)`, or a dtype-converting copy, which torch routes
through a pageable temporary) can hold the host until the stream reaches it, i.e. until the step still
running on the GPU ends, which undoes async scheduling. Checked from the profiler's memcpy records over
whole generate calls (prefill, mixed and decode steps; greedy, sampled and penalized rows), eager and with graphs.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from glm_ray import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU present")]


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_steps_copy_to_the_device_only_from_pinned_memory(oracle_dir, eager):
    llm = LLM(oracle_dir, device="cuda", dtype="bfloat16", kv_cache_memory_bytes=256 << 20, max_num_seqs=8,
              max_model_len=1024, enforce_eager=eager)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 1000, (n,), generator=g).tolist()} for n in (3, 40, 9, 70, 5)]
    sps = [SamplingParams(max_tokens=n, ignore_eos=True, **({"temperature": 0} if i % 2 else
                                                            {"temperature": 0.8, "top_p": 0.9, "top_k": 20}),
                          **({"repetition_penalty": 1.2, "frequency_penalty": 0.3, "min_tokens": 4} if i == 3 else {}))
           for i, n in enumerate((12, 30, 7, 25, 16))]
    llm.generate(prompts[:2], sps[:2], use_tqdm=False)                   # first-use work out of the window
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        outs = llm.generate(prompts, sps, use_tqdm=False)
        torch.cuda.synchronize()
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 30, 7, 25, 16]
    copies = Counter(e.name for e in prof.events() if e.name.startswith("Memcpy HtoD"))
    assert copies, "no host -> device copy recorded (the profiler's names changed?)"
    assert not [k for k in copies if "Pageable" in k], dict(copies)
