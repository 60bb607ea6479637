"""GLM-5.3-Flash (glm5_next) on the GPU (skipped without one): KDA (chunked prefill, recurrent
decode, state slots), the k-pool indexer, NoPE MLA and mHC give the same greedy tokens on the GPU as
on the CPU in fp32 (logprobs within 1e-3), on a tiny checkpoint from `glm-ray make-tiny --config
glm53-flash-tiny-text.json` (our writer: the GPU machine's transformers has no glm5_next; the CPU
suite checks that transformers loads this format and agrees, tests/model/test_glm5_next.py)."""
from __future__ import annotations

import pytest
import torch

from glm_ray import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU present")]


@pytest.fixture(scope="module")
def flash_tiny(tmp_path_factory) -> str:
    from glm_ray.model.tiny import bundled_config, write_tiny
    cfg = bundled_config("glm53-flash-tiny-text.json")
    cfg.update(index_topk=8, index_n_heads=16)      # sparse beyond 8 tokens; 16 heads: no exact score ties
    return str(write_tiny(tmp_path_factory.mktemp("flash") / "tiny", cfg))


def _run(path, device, dtype, chunk=2048):
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 1000, (n,), generator=g).tolist()} for n in (7, 33, 130)]
    llm = LLM(path, device=device, dtype=dtype, kv_cache_memory_bytes=256 << 20, max_num_batched_tokens=chunk)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
    return llm.generate(prompts, sp, use_tqdm=False)


@pytest.mark.parametrize("chunk", [2048, 48], ids=["one-shot-prefill", "chunked-prefill"])
def test_gpu_fp32_matches_cpu(flash_tiny, chunk):
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu, gpu = _run(flash_tiny, "cpu", "float32", chunk), _run(flash_tiny, "cuda", "float32", chunk)
    for a, b in zip(cpu, gpu):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert ta == tb
        assert max(abs(x[t] - y[t]) for x, y, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, ta)) < 1e-3


def test_gpu_bf16_smoke(flash_tiny):
    for o in _run(flash_tiny, "cuda", "bfloat16"):
        c = o.outputs[0]
        assert len(c.token_ids) == 24
        for tok, lp in zip(c.token_ids, c.logprobs):
            assert lp[tok] <= 0 and lp[tok] == max(lp.values())
