"""KimiDeltaAttention (glm_ray/layers/kda.py) vs transformers' Glm5NextTextLinearAttention on random fp32
weights: a packed prefill step of two fresh sequences, decode steps continuing from the state caches,
and a continued prefill chunk, all compared with transformers run on the full sequences (no cache).
Weights go through our weight loaders under the on-disk names; TP=2 is simulated by loading rank
shards and summing the two partial o_proj outputs."""
from __future__ import annotations

import dataclasses
import json
from importlib import resources

import pytest
import torch

from glm_ray.config import ModelConfig
from glm_ray.forward_batch import build_forward_batch, contiguous_block_tables
from glm_ray.layers import kda as kda_mod
from glm_ray.layers import linear as linear_mod
from glm_ray.layers.kda import KimiDeltaAttention
from glm_ray.quant import Unquantized
from glm_ray.weights import CheckpointTensor
from tests import flash_tiny

hf = flash_tiny.import_oracle("transformers.models.glm5_next.modeling_glm5_next")
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig  # noqa: E402

BS = 16


def _configs(**over):
    d = json.loads(resources.files("glm_ray.configs").joinpath("glm53-flash-tiny-text.json").read_text())
    d.update(over, architectures=["Glm5NextForConditionalGeneration"])
    return ModelConfig.from_hf(d, dtype=torch.float32), Glm5NextTextConfig(**d)


def _reference(tcfg, seed=0):
    ref = hf.Glm5NextTextLinearAttention(tcfg, layer_idx=0).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape).uniform_(1, 16, generator=gen)))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name == "o_norm.weight":
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name == "conv1d.weight":
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return ref


def _disk_tensors(ref) -> dict[str, torch.Tensor]:
    """transformers' module state -> the checkpoint's on-disk names (unfused convs, un-nested gate)."""
    sd = {k.removeprefix("forget_gate."): v for k, v in ref.state_dict().items()}
    conv = sd.pop("conv1d.weight")                                             # [3·H·dk, 1, K] = q|k|v
    for name, w in zip(("q", "k", "v"), conv.chunk(3)):
        sd[f"{name}_conv1d.weight"] = w.clone()
    return sd


def _ours(cfg, ref, tp=1, rank=0, monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setattr(kda_mod, "tp_rank", lambda: rank)
        monkeypatch.setattr(linear_mod, "tp_rank", lambda: rank)
    layer = KimiDeltaAttention(cfg, layer_idx=0, quant_config=Unquantized(), prefix="layers.0.self_attn",
                               params_dtype=torch.float32, tp=tp)
    disk = _disk_tensors(ref)
    names = dict(layer.named_parameters())
    assert set(names) == set(disk)                                            # 1:1 with the checkpoint
    for name, p in names.items():
        owner = layer.get_submodule(name.rpartition(".")[0]) if "." in name else layer
        loader = getattr(p, "weight_loader", None) or getattr(owner, "weight_loader")
        loader(p, CheckpointTensor.from_tensor(name, disk[name]))
    assert layer.conv_weight().dtype == torch.float32
    return layer


def _batch(qlens, clens, slots):
    b = build_forward_batch(qlens, clens, contiguous_block_tables(clens, BS), BS, torch.device("cpu"))
    starts = torch.tensor([0] + qlens).cumsum(0)[:-1].tolist()
    groups = []
    for g in b.groups:                                                        # sequence order of the group
        seqs = [starts.index(r) for r in g.q_index[:, 0].tolist()]
        groups.append(dataclasses.replace(
            g, state_slots=torch.tensor([slots[i] for i in seqs]),
            state_fresh=torch.tensor([clens[i] == qlens[i] for i in seqs])))
    return dataclasses.replace(b, groups=tuple(groups))


def _caches(cfg, S=8, h=None):
    h = h or cfg.linear_num_heads
    dk, K = cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    gen = torch.Generator().manual_seed(9)                                    # garbage: fresh rows ignore it
    return (torch.randn(S, K - 1, 3 * h * dk, generator=gen), torch.randn(S, h, dk, dk, generator=gen))


def _pack(seqs, ranges):
    return torch.cat([s[a:b] for s, (a, b) in zip(seqs, ranges)])


@torch.no_grad()
def _run_steps(cfg, layers, caches, lens=(70, 23), extra=(1, 1, 12), slots=(5, 2)):
    """Fresh prefill of two sequences (`lens`), then per `e` in `extra` a step where seq0 adds e tokens
    (a decode, or a continued prefill chunk) and seq1 decodes one. Yields (ours [T, D], transformers
    on the full sequences at the same rows [T, D]) per step; `layers`/`caches` are per simulated rank."""
    ref = layers[0][1]
    steps = [list(lens)] + [[e, 1] for e in extra]
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(sum(s[i] for s in steps), cfg.hidden_size, generator=gen) for i in range(2)]
    full = [ref(x[None])[0] for x in xs]                                      # transformers, no cache
    done = [0, 0]
    for q in steps:
        rng = [(done[i], done[i] + q[i]) for i in range(2)]
        ctx = [done[i] + q[i] for i in range(2)]
        batch = _batch(q, ctx, list(slots))
        x = _pack(xs, rng)
        out = sum(layer(x, batch, *c) for (layer, _), c in zip(layers, caches))
        yield out, _pack(full, rng)
        done = ctx


def test_prefill_then_decode_matches_transformers():
    cfg, tcfg = _configs()
    ref = _reference(tcfg)
    ours = _ours(cfg, ref)
    for out, want in _run_steps(cfg, [(ours, ref)], [_caches(cfg)]):
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def test_softplus_gate_without_lower_bound():
    cfg, tcfg = _configs(linear_lower_bound=None)
    assert cfg.linear_lower_bound is None and tcfg.linear_lower_bound is None
    ref = _reference(tcfg, seed=3)
    ours = _ours(cfg, ref)
    for out, want in _run_steps(cfg, [(ours, ref)], [_caches(cfg)], lens=(40, 5), extra=(1, 3)):
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def test_tp2_shards_sum_to_full(monkeypatch):
    cfg, tcfg = _configs()
    ref = _reference(tcfg, seed=4)
    ranks = []
    for r in range(2):
        ranks.append((_ours(cfg, ref, tp=2, rank=r, monkeypatch=monkeypatch), ref))
        assert ranks[-1][0].A_log.shape == (cfg.linear_num_heads // 2,)
    caches = [_caches(cfg, h=cfg.linear_num_heads // 2) for _ in range(2)]
    for out, want in _run_steps(cfg, ranks, caches, lens=(30, 9), extra=(1, 5)):
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def test_heads_not_divisible_raise():
    cfg, _ = _configs()
    with pytest.raises(ValueError, match="linear_num_heads"):
        KimiDeltaAttention(cfg, layer_idx=0, quant_config=Unquantized(), prefix="x", params_dtype=torch.float32, tp=3)


@torch.no_grad()
def test_bf16_layer_tracks_fp32():
    """Model-dtype params and conv cache, fp32 conv weights / recurrent state: close to the fp32 layer."""
    cfg, tcfg = _configs()
    ref = _reference(tcfg, seed=5)
    ours = _ours(cfg, ref)
    half = KimiDeltaAttention(cfg, layer_idx=0, quant_config=Unquantized(), prefix="p",
                              params_dtype=torch.bfloat16, tp=1)
    half.load_state_dict(ours.state_dict())
    assert half.q_conv1d.weight.dtype == half.A_log.dtype == torch.float32
    assert half.q_proj.weight.dtype == torch.bfloat16
    S, h, dk = 4, cfg.linear_num_heads, cfg.linear_head_dim
    c32 = (torch.zeros(S, 3, 3 * h * dk), torch.zeros(S, h, dk, dk))
    c16 = (torch.zeros(S, 3, 3 * h * dk, dtype=torch.bfloat16), torch.zeros(S, h, dk, dk))
    x = torch.randn(52, cfg.hidden_size)
    for q, c in (([40, 10], [40, 10]), ([1, 1], [41, 11])):
        b = _batch(q, c, [0, 3])
        xs, x = x[:sum(q)], x[sum(q):]
        o32, o16 = ours(xs, b, *c32), half(xs.bfloat16(), b, *c16)
        assert o16.dtype == torch.bfloat16 and c16[1].dtype == torch.float32
        torch.testing.assert_close(o16.float(), o32, rtol=5e-2, atol=5e-2)
