"""The k-pool DSA indexer (glm_ray/layers/kpool_indexer.py) vs transformers' Glm5NextTextIndexer on
random fp32 weights: the boolean attention mask transformers builds from its top-k indices
(Glm5NextTextAttention.build_attention_mask_from_topk, sdpa form) against ours, for one-shot
prefill, packed sequences, chunked continuation and decode (ours reads earlier tokens from its cache;
transformers runs the full sequence and we compare the new queries' rows).

16 indexer heads (not the tiny config's 4) make exact score ties negligible: with few heads ReLU
zeroes whole scores and top-k would break the ties arbitrarily.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from glm_ray.config import ModelConfig
from glm_ray.forward_batch import build_forward_batch
from glm_ray.layers import kpool_indexer
from glm_ray.layers.kpool_indexer import KPoolIndexer
from glm_ray.quant import Unquantized
from glm_ray.weights import CheckpointTensor
from tests import flash_tiny

flash_tiny.import_oracle("transformers.models.glm5_next")

CONFIG = Path(__file__).parents[2] / "glm_ray" / "configs" / "glm53-flash-tiny-text.json"
BLOCK = 4


def _text_config(**over) -> dict:
    text = {k: v for k, v in json.loads(CONFIG.read_text()).items() if k not in ("architectures", "model_type")}
    text.update({"index_n_heads": 16, "index_topk": 8, **over})
    return text


def _build(**over):
    """(transformers attention module with its indexer, our KPoolIndexer with the same weights)."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention
    text = _text_config(**over)
    hf_cfg = Glm5NextTextConfig(**text)
    hf_cfg._attn_implementation = "sdpa"
    attn = Glm5NextTextAttention(hf_cfg, layer_idx=3).float().eval()
    ref = attn.indexer
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name == "k_norm.weight":
                p.copy_(1.0 + 0.1 * r)
            elif name in ("k_norm.bias", "index_kpool_compress_ape"):
                p.copy_(0.5 * r)
            else:                                   # projections and the pool gate: unit-scale outputs
                p.copy_(r * p.shape[-1] ** -0.5)
    cfg = ModelConfig.from_hf({**text, "architectures": ["Glm5NextForConditionalGeneration"]}, dtype="float32")
    ours = KPoolIndexer(cfg, quant_config=Unquantized(), prefix="indexer", params_dtype=torch.float32)
    sd = dict(ref.named_parameters())
    for name, p in ours.named_parameters():        # through the checkpoint loaders
        owner = ours.get_submodule(name.rsplit(".", 1)[0]) if "." in name else ours
        loader = getattr(p, "weight_loader", None) or owner.weight_loader
        loader(p, CheckpointTensor.from_tensor(name, sd[name].detach().clone()))
    assert set(sd) == {n for n, _ in ours.named_parameters()}
    return attn, ours, cfg


def _ref_mask(attn, x: torch.Tensor, q_resid: torch.Tensor) -> torch.Tensor:
    """transformers' [S, S] bool mask of one whole sequence (no cache, no padding)."""
    S = x.shape[0]
    idx = attn.indexer(x[None], q_resid[None], torch.ones(1, S, dtype=torch.bool), None)
    return attn.build_attention_mask_from_topk(idx, x[None], S)[0, 0]


def _seqs(lens, cfg, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, cfg.hidden_size, generator=g), torch.randn(n, cfg.q_lora_rank, generator=g))
            for n in lens]


def _tables(ctx_lens):
    """Interleaved (non-contiguous) block tables: sequence i owns blocks i, i+B, i+2B, ..."""
    B, nb = len(ctx_lens), max(-(-c // BLOCK) for c in ctx_lens)
    return [[i + B * j for j in range(-(-c // BLOCK))] for i, c in enumerate(ctx_lens)], B * nb * BLOCK


def _run(ours, cfg, seqs, steps):
    """Feed the sequences through `steps` (each a list of new-token counts per sequence; 0 = idle) and
    return, for the last step, {(seq, pos): mask row [ctx]} plus the masks and batch of that step."""
    total = [s[0].shape[0] for s in seqs]
    tables, num_slots = _tables(total)
    cache = torch.full((num_slots, ours.cache_dim), float("nan"))    # never-written rows are NaN
    done = [0] * len(seqs)
    rows = {}
    for step_i, step in enumerate(steps):
        ids = [i for i, q in enumerate(step) if q > 0]
        ql = [step[i] for i in ids]
        cl = [done[i] + step[i] for i in ids]
        batch = build_forward_batch(ql, cl, [tables[i] for i in ids], BLOCK, torch.device("cpu"))
        x = torch.cat([seqs[i][0][done[i]:done[i] + step[i]] for i in ids])
        qr = torch.cat([seqs[i][1][done[i]:done[i] + step[i]] for i in ids])
        ours.write_keys(x, batch, None, cache)
        if step_i == len(steps) - 1:
            tok = [(i, done[i] + j) for i in ids for j in range(step[i])]    # row of T -> (seq, pos)
            iq = ours.queries(x, qr, None)
            for grp in batch.groups:
                mask = ours.select(grp, iq, cache)
                assert mask.shape == grp.causal.shape and not (mask & ~grp.causal).any()
                for b, j in grp.q_valid.nonzero().tolist():
                    s, pos = tok[int(grp.q_index[b, j])]
                    ctx = done[s] + step[s]
                    assert not mask[b, j, ctx:].any()
                    rows[(s, pos)] = mask[b, j, :ctx]
        for i in ids:
            done[i] += step[i]
    return rows


def _check(attn, seqs, rows):
    refs = {}
    for (s, pos), row in rows.items():
        if s not in refs:
            refs[s] = _ref_mask(attn, *seqs[s])
        ref = refs[s][pos, :row.shape[0]]
        assert torch.equal(row, ref), f"seq {s} pos {pos}:\nours {row.int().tolist()}\nref  {ref.int().tolist()}"
    return refs


@pytest.mark.parametrize("tail", [True, False])
def test_prefill_one_sequence(tail):
    attn, ours, cfg = _build(index_kpool_always_select_tail=tail)
    assert ours.cache_dim == 2 * cfg.index_head_dim == cfg.index_cache_dim
    seqs = _seqs([45], cfg)
    rows = _run(ours, cfg, seqs, [[45]])
    refs = _check(attn, seqs, rows)
    assert len(rows) == 45
    m = refs[0]
    causal = torch.ones(45, 45, dtype=torch.bool).tril()
    assert not (m & ~causal).any() and (m.sum(-1)[20:] < causal.sum(-1)[20:]).all()   # really sparse
    if tail:   # a query whose own pool is incomplete sees that pool's tokens up to itself
        own = torch.arange(45) % 4 != 3
        assert m.diagonal()[own].all()


def test_packed_sequences():
    attn, ours, cfg = _build()
    seqs = _seqs([37, 22, 3], cfg, seed=2)
    rows = _run(ours, cfg, seqs, [[37, 22, 3]])
    _check(attn, seqs, rows)
    assert len(rows) == 62


def test_chunked_and_decode_mixed():
    """Earlier steps cache context; the last step mixes a decode, a continued chunk and a fresh prompt."""
    attn, ours, cfg = _build()
    seqs = _seqs([41, 58, 30, 26], cfg, seed=3)
    steps = [[17, 23, 0, 0],
             [23, 21, 0, 25],          # seq 0 finishes its prompt, seq 3: all but its last token
             [1, 14, 30, 1]]           # decode (ctx 41), chunk 44..57, fresh prompt, decode (ctx 26)
    rows = _run(ours, cfg, seqs, steps)
    _check(attn, seqs, rows)
    assert {(0, 40), (1, 44), (1, 57), (2, 0), (2, 29), (3, 25)} <= set(rows)


def test_tiled_equals_untiled(monkeypatch):
    """Tiny score budget: every pool tile and query tile is minimal; same masks."""
    attn, ours, cfg = _build()
    seqs = _seqs([53, 29], cfg, seed=4)
    steps = [[40, 0], [13, 29]]
    want = _run(ours, cfg, seqs, steps)
    monkeypatch.setattr(kpool_indexer, "_SCORE_BYTES", 1)
    got = _run(ours, cfg, seqs, steps)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    _check(attn, seqs, got)


def test_short_contexts_are_dense_causal():
    """max_context_len <= topk: the selection is exactly causal (the MLA layer's skip is exact)."""
    _, ours, cfg = _build(index_topk=16)
    assert ours.topk == 16
    seqs = _seqs([16, 11, 5, 16], cfg, seed=5)
    total = [16, 11, 5, 16]
    tables, num_slots = _tables(total)
    cache = torch.randn(num_slots, ours.cache_dim)
    for ql, cl in (([16, 11, 5], [16, 11, 5]), ([7, 1, 3], [16, 11, 5])):
        batch = build_forward_batch(ql, cl, tables[:3], BLOCK, torch.device("cpu"))
        x = torch.cat([seqs[i][0][c - q:c] for i, (q, c) in enumerate(zip(ql, cl))])
        qr = torch.cat([seqs[i][1][c - q:c] for i, (q, c) in enumerate(zip(ql, cl))])
        ours.write_keys(x, batch, None, cache)
        iq = ours.queries(x, qr, None)
        for grp in batch.groups:
            assert grp.max_context_len <= ours.topk
            assert torch.equal(ours.select(grp, iq, cache), grp.causal)


def test_no_tail_never_skips():
    _, ours, _ = _build(index_kpool_always_select_tail=False)
    assert ours.topk == 0
