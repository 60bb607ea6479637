"""GLM-5.3-Flash (glm5_next) end to end: glm_ray's engine vs transformers' own
Glm5NextForConditionalGeneration (text input) on a checkpoint that transformers wrote, fp32.

The checkpoint is transformers' `save_pretrained` of a randomly initialised tiny model (the on-disk
names of a real GLM-5.3-Flash checkpoint: `model.language_model.*`, separate q/k/v conv1d, per-expert
MoE tensors, flat `hc_*` tensors, plus a vision tower we do not load). The parameters transformers
initialises to constants (mHC base/scale, k-pool ape/gate, A_log, norms) are randomised first so that
every path carries signal. index_topk 8 with k-pools of 4 keeps every prompt beyond 8 tokens sparse.
Covered: KDA prefill (chunked form) and decode (recurrent form), KDA state carried across prefill
chunks of a continuing sequence, the k-pool indexer with its tail, NoPE MLA, mHC, clamped SwiGLU MoE.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from glm_ray import LLM, SamplingParams

pytest.importorskip("transformers.models.glm5_next")

TOL = 1e-4
CONFIG = Path(__file__).parents[2] / "glm_ray" / "configs" / "glm53-flash-tiny-text.json"


@pytest.fixture(scope="module")
def flash_dir(tmp_path_factory) -> str:
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration
    text = {k: v for k, v in json.loads(CONFIG.read_text()).items() if k not in ("architectures", "model_type")}
    text.update(index_topk=8, eos_token_id=1, dtype="float32")
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"])
    torch.manual_seed(0)
    model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=vision)).float()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.model.language_model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith(("attn_hc.base", "ffn_hc.base", "index_kpool_compress_ape", "e_score_correction_bias")):
                p.copy_(0.5 * r)
            elif name.endswith(("attn_hc.scale", "ffn_hc.scale")):
                p.copy_(1.0 + 0.3 * r)
            elif name.endswith("index_kpool_compress_gate"):
                p.copy_(0.2 * r)
            elif name.endswith("A_log"):
                p.copy_(0.5 * r)
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * r)
        model.lm_head.weight.mul_(4.0)   # sharper next-token distributions: greedy parity not decided by 1e-6 gaps
    path = tmp_path_factory.mktemp("glm53flash") / "tiny"
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def oracle(flash_dir):
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration
    return Glm5NextForConditionalGeneration.from_pretrained(flash_dir, dtype=torch.float32).eval()


@torch.no_grad()
def _oracle_logprobs(oracle, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(oracle(input_ids=torch.tensor([ids])).logits[0].float(), -1)   # [S, V]


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
        ref = _oracle_logprobs(oracle, p + gen.token_ids)                     # [P+G, V]
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
    from glm_ray.engine.kv_cache import kv_bytes_per_token, state_bytes
    cfg = ModelConfig.from_pretrained(flash_dir, "float32")
    budget = state_bytes(cfg, torch.float32, 4, 1) + 96 * kv_bytes_per_token(cfg, torch.float32)   # 6 blocks
    prompts = _prompts((40, 41, 42, 43), seed=3)
    llm = LLM(flash_dir, dtype="float32", kv_cache_memory_bytes=budget, max_num_seqs=4, max_num_batched_tokens=64)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert llm.engine.num_preemptions > 0
    for p, o in zip(prompts, outs):
        gen = o.outputs[0]
        ref = _oracle_logprobs(oracle, p + gen.token_ids)
        for j, t in enumerate(gen.token_ids):
            assert t == int(ref[len(p) - 1 + j].argmax()), f"greedy token {j} differs"
            assert abs(gen.logprobs[j][t] - ref[len(p) - 1 + j, t].item()) < TOL
