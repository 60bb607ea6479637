"""GLM-5.3-Flash (glm5_next) end to end: glm_ray's engine vs transformers' own
Glm5NextForConditionalGeneration (text input) on a checkpoint that transformers wrote, fp32.

The checkpoint is transformers' own `save_pretrained` output (tests/flash_tiny.py).
Covered: KDA prefill (chunked form) and decode (recurrent form), KDA state carried across prefill
chunks of a continuing sequence, the k-pool indexer with its tail, NoPE MLA, mHC, clamped SwiGLU MoE.
"""
from __future__ import annotations

import pytest
import torch

from glm_ray import LLM, SamplingParams
from tests import flash_tiny
from tests.flash_tiny import flash_oracle_logprobs, load_flash_oracle, write_flash_tiny

flash_tiny.import_oracle("transformers.models.glm5_next")

TOL = 1e-4


@pytest.fixture(scope="module")
def flash_dir(tmp_path_factory) -> str:
    return write_flash_tiny(tmp_path_factory.mktemp("glm53flash") / "tiny")


@pytest.fixture(scope="module")
def oracle(flash_dir):
    return load_flash_oracle(flash_dir)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 1000, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("chunk", [2048, 7], ids=["one-shot-prefill", "chunked-prefill"])
def test_logprobs_match_transformers(flash_dir, oracle, chunk):
    prompts = _prompts((5, 30, 57))
    llm = LLM(flash_dir, dtype="float32", kv_cache_memory_bytes=32 << 20, max_num_batched_tokens=chunk)
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    worst_prompt = worst_gen = 0.0
    for p, o in zip(prompts, outs):
        gen = o.outputs[0]
        ref = flash_oracle_logprobs(oracle, p + gen.token_ids)                     # [P+G, V]
        for i in range(1, len(p)):
            worst_prompt = max(worst_prompt, abs(o.prompt_logprobs[i][p[i]] - ref[i - 1, p[i]].item()))
        for j, t in enumerate(gen.token_ids):
            assert t == int(ref[len(p) - 1 + j].argmax()), f"greedy token {j} differs"
            worst_gen = max(worst_gen, abs(gen.logprobs[j][t] - ref[len(p) - 1 + j, t].item()))
    assert worst_prompt < TOL and worst_gen < TOL, (worst_prompt, worst_gen)


def test_preempted_request_restarts_its_state(flash_dir, oracle):
    """A KV cache too small for all sequences at once forces preemption: a recomputed request starts
    again from position 0 and must start from a zero KDA state, not from what its new slot holds."""
    from glm_ray.config import ModelConfig
    from glm_ray.worker.cache import kv_bytes_per_token, state_bytes
    cfg = ModelConfig.from_pretrained(flash_dir, "float32")
    budget = state_bytes(cfg, torch.float32, 4, 1) + 96 * kv_bytes_per_token(cfg, torch.float32)   # 6 blocks
    prompts = _prompts((40, 41, 42, 43), seed=3)
    llm = LLM(flash_dir, dtype="float32", kv_cache_memory_bytes=budget, max_num_seqs=4, max_num_batched_tokens=64)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert llm.engine.num_preemptions > 0
    for p, o in zip(prompts, outs):
        gen = o.outputs[0]
        ref = flash_oracle_logprobs(oracle, p + gen.token_ids)
        for j, t in enumerate(gen.token_ids):
            assert t == int(ref[len(p) - 1 + j].argmax()), f"greedy token {j} differs"
            assert abs(gen.logprobs[j][t] - ref[len(p) - 1 + j, t].item()) < TOL
