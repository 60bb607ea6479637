"""`python -m glm_ray.bench.prefill` on CPU with the tiny model (rows, and that every timed step really
prefills B fresh L-token prompts through the runner's diff protocol), the FLOP formula on glm5-flash-31b
against a hand calculation, and its linear part against the parameters of a built model."""
from __future__ import annotations

import json
import math
from importlib import resources

import pytest

from glm_ray.bench import decode, prefill
from glm_ray.layers.moe import FusedMoE

BS = 16


def test_main_prefills_fresh_prompts(tmp_path, monkeypatch, runner_calls):
    monkeypatch.setenv("GLM_RAY_CACHE", str(tmp_path / "cache"))
    seen = runner_calls
    out_json = tmp_path / "rows.jsonl"
    steps, warmup, prof = 2, 1, 1
    assert prefill.main(["glm5-tiny", "--device", "cpu", "--shape", "1x40", "2x24", "--steps", str(steps),
                         "--warmup", str(warmup), "--profile-steps", str(prof), "--profile-top", "3",
                         "--modes", "eager", "piecewise", "--json", str(out_json)]) == 0
    rows = [json.loads(line) for line in out_json.read_text().splitlines()]
    assert [(r["batch"], r["length"], r["quant"], r["mode"]) for r in rows] == [
        (1, 40, "fp8", "eager"), (1, 40, "fp8", "piecewise"), (2, 24, "fp8", "eager"), (2, 24, "fp8", "piecewise")]
    for r in rows:
        assert r["pieces"] == 0                   # no graphs on the CPU: a piecewise row runs eagerly and says so
        assert r["step_ms"] > 0 and 0 < r["host_ms"] <= r["step_ms"] + 1e-9 and math.isnan(r["device_ms"])
        # the runner's own split of a step: each part inside the step
        split = r["host_split_ms"]
        assert set(split) == {"prepare", "forward", "sample"} and min(split.values()) >= 0
        assert split["forward"] > 0 and max(split.values()) <= r["step_ms"] * 1.05
        assert r["floor_ms"] == r["floor_fp8_ms"] <= r["floor_bf16_ms"]
        assert r["ratio_wall"] == pytest.approx(r["step_ms"] / r["floor_ms"])
        assert r["tflops_wall"] == pytest.approx(r["flops"]["total"] / r["step_ms"] / 1e9)
    # every step with sequences: B new requests, whole prompts from position 0 on ceil(L/bs) fresh blocks,
    # each sampled; the previous step's requests finished in the same diff, and all finished at the end
    shapes = [(1, 40)] * 2 * (warmup + steps + prof) + [(2, 24)] * 2 * (warmup + steps + prof)
    steps_seen = [(so, out) for so, out in seen if so.seqs]
    assert [(len(so.seqs), len(so.seqs[0].token_ids)) for so, _ in steps_seen] == shapes
    live: set[str] = set()
    finished: set[str] = set()
    for so, out in seen:
        assert set(so.finished_req_ids) == live
        finished |= set(so.finished_req_ids)
        if not so.seqs:
            live = set()
            continue
        new = {nr.req_id: nr for nr in so.new_requests}
        assert set(new) == {s.req_id for s in so.seqs} and not (set(new) & finished)
        for s in so.seqs:
            assert s.start_pos == 0 and s.reset_blocks and s.sample
            assert s.token_ids == new[s.req_id].prompt_token_ids and len(s.block_ids) == -(-len(s.token_ids) // BS)
        assert set(out.sampled) == set(new)
        live = set(new)
    assert live == set()


def test_flops_flash_31b_by_hand():
    """glm5-flash-31b (see test_decode_bench): per token the quantized linears are q_a 768x2048, q_b 8192x768,
    kv_a 576x2048, kv_b 32*(192+256)x512 (the naive prefill expands every context token), o_proj 2048x8192,
    the indexer's wk 128x2048; MLPs: 1 dense 3x10240x2048, 46 MoE layers of (top-4 + 1 shared) x 3x1536x2048;
    routers 64x2048 (bf16 side). Attention per layer and query at position p: 2 * 32 * (192+64+256) FLOPs
    per key, p + 1 keys (dense while L <= 2048), at most 2048 keys past it; the indexer (all 47 layers
    full) scores p + 1 keys with 32 x 128 while L > 2048, its wq_b 4096x768 and weights_proj 32x2048 then."""
    cfg = decode.ModelConfig.from_hf(json.loads(
        resources.files("glm_ray.configs").joinpath("glm5-flash-31b.json").read_text()))
    attn_lin = 768 * 2048 + 8192 * 768 + 576 * 2048 + 32 * 448 * 512 + 2048 * 8192 + 128 * 2048
    mlp = 3 * 10240 * 2048 + 46 * 5 * 3 * 1536 * 2048
    lm = 2 * 154880 * 2048
    # 8 x 1024: no scoring
    f = prefill.prefill_flops(cfg, 8, 1024)
    T = 8 * 1024
    assert f["linear_quant"] == 2 * T * (47 * attn_lin + mlp)
    assert f["linear_bf16"] == 2 * T * 46 * 64 * 2048 + 8 * lm
    assert f["attention"] == 47 * 8 * 2 * 32 * 512 * (1024 * 1025 // 2)
    assert f["indexer"] == 0
    # 1 x 8192: scoring; attention capped at 2048 keys
    f = prefill.prefill_flops(cfg, 1, 8192)
    assert f["linear_quant"] == 2 * 8192 * (47 * (attn_lin + 4096 * 768) + mlp)
    assert f["linear_bf16"] == 2 * 8192 * (46 * 64 * 2048 + 47 * 32 * 2048) + lm
    keys = 2048 * 2049 // 2 + (8192 - 2048) * 2048
    assert f["attention"] == 47 * 2 * 32 * 512 * keys
    assert f["indexer"] == 47 * 2 * (8192 * 8193 // 2) * 32 * 128
    assert f["total"] == sum(v for k, v in f.items() if k != "total")
    bf16, fp8 = prefill.floors_ms(f, bf16_tflops=800, fp8_tflops=1600)
    assert bf16 == pytest.approx(f["total"] / 800e12 * 1e3)
    assert fp8 == pytest.approx((f["linear_quant"] / 1600e12 + (f["total"] - f["linear_quant"]) / 800e12) * 1e3)


def test_linear_flops_match_the_built_model(tmp_path, monkeypatch):
    """The formula's linear parameters per token == those of the built tiny model (bf16 checkpoint: no
    scales), counted from its modules: every weight matrix of the decoder layers (the MTP layer skipped),
    routed experts at top_k of E, plus the lm_head on the sampled rows. L past index_topk: every indexer
    weight is used."""
    monkeypatch.setenv("GLM_RAY_CACHE", str(tmp_path / "cache"))
    w = decode.build_worker(decode.model_dir_for("glm5-tiny", "bf16", tmp_path), device="cpu", dtype="auto",
                            mode="eager", max_batch=1, max_context=32, steps_total=1)
    cfg = w.model_cfg
    L = 4 * cfg.index_topk
    per_token = 0.0
    for name, mod in w.model.named_modules():
        m = decode._LAYER.search(name)
        if m is None or int(m.group(1)) >= cfg.num_hidden_layers:
            continue
        for p in mod.parameters(recurse=False):
            if p.dim() < 2:
                continue                                       # norms, biases
            n = p.numel()
            per_token += n * cfg.num_experts_per_tok / mod.num_experts if isinstance(mod, FusedMoE) else n
    f = prefill.prefill_flops(cfg, 1, L)
    lm = 2 * cfg.vocab_size * cfg.hidden_size
    assert f["linear_quant"] + f["linear_bf16"] - lm == pytest.approx(2 * L * per_token)
    assert f["attention"] > 0 and f["indexer"] > 0
