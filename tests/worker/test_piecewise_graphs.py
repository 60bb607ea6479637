"""The piecewise prefill-graph path on the CPU (worker/piecewise_graph.py run without capture): the model's
pieces over the static buffers, token buckets with padding rows writing the scratch block, and the eager
attentions between them must compute what the eager forward computes — the same hidden states (fp32
round-off) for prefill, chunked-prefill and mixed steps, contexts below and past index_topk — and an
engine serving with them must generate the same tokens. (Capture and replay: tests/gpu/test_piecewise_graphs.py.)"""
from __future__ import annotations

import pytest
import torch

from glm_ray.config import ModelConfig
from glm_ray.engine.sampling_params import SamplingParams
from glm_ray.forward_batch import build_forward_batch
from glm_ray.llm import LLM
from glm_ray.model import MODEL_CLASSES
from glm_ray.model.loader import init_dummy_weights
from glm_ray.quant import get_quant_config
from glm_ray.worker import model_runner
from glm_ray.worker.cache import allocate_caches
from glm_ray.worker.piecewise_graph import PiecewiseGraphs, supports_pieces, token_buckets


def test_buckets():
    assert token_buckets(2048) == [16, 32, 64, 96, 128, 192, 256, 384, 512, 640, 768, 1024, 1280, 1536, 1792, 2048]
    assert token_buckets(100) == [16, 32, 64, 96, 100]
    assert token_buckets(4000)[-4:] == [3072, 3584, 4000][-3:] or token_buckets(4000)[-3:] == [3072, 3584, 4000]
    assert token_buckets(8192)[16:] == list(range(2560, 8192, 512)) + [8192]
    assert 700 in token_buckets(2048, extra=[700]) and 4096 not in token_buckets(2048, extra=[4096])


def _model(path):
    cfg = ModelConfig.from_pretrained(path, "float32")
    model = MODEL_CLASSES[cfg.architecture](cfg, get_quant_config(cfg), cfg.dtype).eval()
    init_dummy_weights(model, seed=3)
    model.process_weights_after_loading()
    return cfg, model


# (query_lens, context_lens): a fresh prompt, a chunk after a cached prefix past index_topk (8), a mixed
# step (decodes beside a prompt), two prompts in one step; and steps whose contexts all fit in
# index_topk (the variant without index queries)
STEPS = [([21], [21]), ([6], [30]), ([1, 1, 9], [33, 12, 9]), ([13, 4], [13, 40]), ([5], [5]), ([1, 3], [8, 3])]


@pytest.mark.parametrize("qlens,clens", STEPS)
def test_pieces_equal_eager_forward(qlens, clens, family_dir):
    cfg, model = _model(family_dir)
    assert supports_pieces(model)
    bs, nb = 4, 64
    tables, nxt = [], 0
    for c in clens:
        n = -(-c // bs)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    T = sum(qlens)
    ids = torch.randint(10, 200, (T,), generator=torch.Generator().manual_seed(1))
    out = []
    with torch.inference_mode():
        for piecewise in (False, True):
            kv, idx, states = allocate_caches(cfg, (nb + 1) * bs, 4, 1, torch.device("cpu"))
            for i, (c, t) in enumerate(zip(clens, tables)):   # cached prefixes (and KDA states): eager first
                if c > max(qlens):
                    pre = build_forward_batch([c], [c], [t], bs, torch.device("cpu"), state_slots=[i])
                    model(torch.randint(10, 200, (c,), generator=torch.Generator().manual_seed(c)), pre, kv, idx,
                          states)
            batch = build_forward_batch(qlens, clens, tables, bs, torch.device("cpu"))
            if piecewise:
                pieces = PiecewiseGraphs(model, kv, idx, states, max_tokens=64, pad_slot=nb * bs,
                                         device=torch.device("cpu"))
                h = pieces.run(ids, batch).clone()
                assert pieces.bucket(T) > T or T == 16       # padding rows ran (and wrote only the scratch block)
                assert {v for v, _ in pieces.keys} == {model.piecewise().index_queries(batch)}
            else:
                h = model(ids, batch, kv, idx, states)
            mla_cache = next(c for c in kv if c is not None)                 # the first MLA layer's
            out.append((h, mla_cache[:nb * bs].clone()))
    (he, kve), (hp, kvp) = out
    assert torch.allclose(he, hp, atol=1e-4, rtol=1e-4), (he - hp).abs().max()   # fp32 round-off
    # the real blocks: the same cache rows up to fp32 round-off (padding rows change the GEMM shapes; GLM-5.3-Flash's
    # first MLA layer sits after three KDA layers: 2-4e-5 apart on torch 2.13's CPU GEMMs), a wrong or
    # missing row is O(1) off
    assert torch.allclose(kve, kvp, atol=1e-4, rtol=1e-4), (kve - kvp).abs().max()


def _generate(path, prompts, max_tokens: int, monkeypatch, **kw):
    with monkeypatch.context() as m:
        m.setattr(model_runner, "graphs_enabled", lambda cfg, device: False)
        m.setattr(model_runner, "piecewise_max_tokens", lambda cfg, model, device: max_tokens)
        llm = LLM(path, dtype="float32", max_num_seqs=4, max_num_batched_tokens=48, block_size=4, **kw)
        runner = llm.engine.executor.worker.runner
        assert (runner.pieces is not None) == bool(max_tokens)
        outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, logprobs=2, ignore_eos=True)
                                      for n in (6, 3, 8, 5, 4)], use_tqdm=False)
        steps = runner.num_piecewise_steps
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], steps


def test_engine_with_pieces_equals_eager(family_dir, monkeypatch):
    """Prompts longer than the step budget (chunked), joining while others decode (mixed steps), contexts
    past index_topk (the indexer scores): the same greedy tokens and logprobs as eager."""
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 200, (n,), generator=g).tolist()} for n in (70, 5, 23, 9, 40)]
    eager, n0 = _generate(family_dir, prompts, 0, monkeypatch)
    piece, n1 = _generate(family_dir, prompts, 48, monkeypatch)
    assert n0 == 0 and n1 >= 5
    for (te, le), (tp, lp) in zip(eager, piece):
        assert te == tp
        for a, b in zip(le, lp):
            assert a.keys() == b.keys() and max(abs(a[t] - b[t]) for t in a) < 1e-4


def test_attention_writes_the_static_carry(oracle_dir, monkeypatch):
    """Under the piecewise path every prefill-form attention group writes its rows of the static "o" carry
    itself (the op gets a view of it as `out`): no [T, h, dv] copy after each layer's attention; the query
    projection writes the static "q" carry and the norms add into the "residual" carry in place (no copy after
    a piece either). The step is a mixed one (decode rows beside a chunk), so a group owns a span of the rows."""
    import dataclasses

    from glm_ray import kernels
    from glm_ray.quant.unquantized import UnquantizedLinearMethod
    cfg, model = _model(oracle_dir)
    base = kernels.ops()
    seen, into = [], []
    apply_into = UnquantizedLinearMethod.apply_into

    def record(self, layer, x, out):
        into.append((layer.prefix, out.data_ptr()))
        return apply_into(self, layer, x, out)

    monkeypatch.setattr(UnquantizedLinearMethod, "apply_into", record)
    inner, same_stream = model.piecewise(), []
    piece = inner.piece

    def traced(k, carry, *a):
        out = piece(k, carry, *a)
        if "residual" in carry and "residual" in out:
            same_stream.append(out["residual"].data_ptr() == carry["residual"].data_ptr())
        return out

    monkeypatch.setattr(inner, "piece", traced)

    def spy(q, kv_cache, group, selection, kv_b, *, out=None, **kw):
        seen.append(out)
        return base.mla_prefill(q, kv_cache, group, selection, kv_b, out=out, **kw)

    monkeypatch.setattr(kernels, "_ACTIVE", dataclasses.replace(base, mla_prefill=spy))
    bs, nb = 4, 64
    qlens, clens = [1, 1, 9], [33, 12, 9]
    tables = [list(range(0, 9)), list(range(9, 12)), list(range(12, 15))]
    with torch.inference_mode():
        kv, idx, states = allocate_caches(cfg, (nb + 1) * bs, 4, 1, torch.device("cpu"))
        batch = build_forward_batch(qlens, clens, tables, bs, torch.device("cpu"))
        pieces = PiecewiseGraphs(model, kv, idx, states, max_tokens=64, pad_slot=nb * bs, device=torch.device("cpu"))
        pieces.run(torch.randint(10, 200, (sum(qlens),)), batch)
        seen.clear()
        into.clear()
        same_stream.clear()
        pieces.run(torch.randint(10, 200, (sum(qlens),)), batch)
    def inside(key, ptr):
        c = pieces.carry[key]
        return c.data_ptr() <= ptr < c.data_ptr() + c.numel() * c.element_size()
    assert len(seen) == cfg.num_hidden_layers and all(o is not None and inside("o", o.data_ptr()) for o in seen)
    # (the first step's piece 0 finds no "q" carry yet: it is made from that run's output; this is the second)
    q_writes = [p for p, ptr in into if p.endswith("q_b_proj") and inside("q", ptr)]
    assert len(q_writes) == cfg.num_hidden_layers, into
    assert same_stream == [True] * (cfg.num_hidden_layers - 1)          # pieces 1..L-1 carry the stream on
