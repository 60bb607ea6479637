"""Sampler behaviour against plain, per-row reference formulas (the sampler itself is batched)."""
from __future__ import annotations

import math

import pytest
import torch

from glm_ray import LLM, SamplingParams
from glm_ray.worker.sampler import SamplingRow, _filter, _penalize, sample


def _rows(params, n_vocab=50, out_ids=(), prompt_ids=(), eos=(1,)):
    return [SamplingRow(p, torch.Generator().manual_seed(p.seed) if p.seed is not None else None,
                        list(prompt_ids), list(out_ids), eos) for p in params]


def test_penalties_match_formula():
    torch.manual_seed(0)
    logits = torch.randn(1, 20)
    p = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25)
    prompt, out = [2, 3], [3, 5, 5, 7]
    got = _penalize(logits, _rows([p], out_ids=out, prompt_ids=prompt))[0]
    ref = logits[0].clone()
    for t in set(prompt + out):                        # HF/vLLM repetition penalty over prompt + output
        ref[t] = ref[t] / 1.3 if ref[t] > 0 else ref[t] * 1.3
    for t in set(out):                                 # OpenAI presence/frequency over the output
        ref[t] -= 0.25 * out.count(t) + 0.5
    assert torch.allclose(got, ref, atol=1e-6)


def test_penalties_batched_rows_match_the_formula_per_row():
    """Rows with and without penalties side by side, histories of different lengths (empty ones too):
    each penalized row equals the per-row formula, the others are untouched."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 30, generator=g)
    cases = [(SamplingParams(repetition_penalty=1.3), [4, 9], [9, 9, 11]),
             (SamplingParams(), [1, 2], [3]),                                          # no penalties
             (SamplingParams(frequency_penalty=0.7, presence_penalty=0.2), [], [5, 5, 5, 6]),
             (SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.3), [7, 7, 8], []),
             (SamplingParams(presence_penalty=1.5), [29], [0, 29])]
    rows = [SamplingRow(p, None, list(pr), list(out), (1,)) for p, pr, out in cases]
    got = _penalize(logits, rows)
    for i, (p, prompt, out) in enumerate(cases):
        ref = logits[i].clone()
        for t in set(prompt + out):
            ref[t] = ref[t] / p.repetition_penalty if ref[t] > 0 else ref[t] * p.repetition_penalty
        for t in set(out):
            ref[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
        assert torch.allclose(got[i], ref, atol=1e-6), i


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]]))
    def keep(**kw):
        return torch.isfinite(_filter(logits.clone(), _rows([SamplingParams(temperature=1.0, **kw)]))[0])
    assert keep(top_k=2).tolist() == [True, True, False, False, False]
    # top-p 0.8: mass before token i is 0, .4, .7, .85 -> keep while < 0.8
    assert keep(top_p=0.8).tolist() == [True, True, True, False, False]
    # min-p 0.3: keep p >= 0.3 * 0.4 = 0.12
    assert keep(min_p=0.3).tolist() == [True, True, True, False, False]


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.zeros(1, 10)
    logits[0, 1] = 10.0      # EOS would win
    logits[0, 4] = 9.0       # stop id next
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[4])
    tok, _ = sample(logits, _rows([p], out_ids=[7]))
    assert tok.item() not in (1, 4)
    tok, _ = sample(logits, _rows([p], out_ids=[7, 7, 7]))
    assert tok.item() == 1


def test_seeded_sampling_is_reproducible_and_distribution_is_right():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).repeat(4000, 1)
    rows = _rows([SamplingParams(temperature=1.0)] * 4000)
    tok, _ = sample(logits, rows)
    freq = torch.bincount(tok, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)      # ~4 sigma at n=4000
    a, _ = sample(logits[:5], _rows([SamplingParams(temperature=1.0, seed=7)] * 5))
    b, _ = sample(logits[:5], _rows([SamplingParams(temperature=1.0, seed=7)] * 5))
    assert a.tolist() == b.tolist()


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, dtype="float32", kv_cache_memory_bytes=16 << 20)


def test_engine_seed_and_n(llm):
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=123, ignore_eos=True, n=3)
    a = llm.generate([[5, 6, 7, 8]], sp, use_tqdm=False)[0]
    b = llm.generate([[5, 6, 7, 8]], sp, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1      # seeds seed+i differ per choice


def test_engine_stop_string_and_stop_ids_and_max_tokens(llm):
    ids = [5, 6, 7, 8, 9]
    base = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 16
    stop = base.text[len(base.text) // 2:len(base.text) // 2 + 2]
    if stop.strip("\ufffd"):
        out = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop]),
                           use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert stop not in out.text and base.text.startswith(out.text)
    sid = base.token_ids[5]
    out = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[sid]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == sid
    assert out.token_ids == base.token_ids[:base.token_ids.index(sid) + 1]


def test_engine_logprobs_are_consistent(llm):
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=5, temperature=0, logprobs=4, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert len(lp) == 4 and lp[tok] == max(lp.values())        # greedy: the sampled token is the top-1
        assert all(v <= 0 for v in lp.values())
        assert sum(math.exp(v) for v in lp.values()) <= 1.0 + 1e-5
