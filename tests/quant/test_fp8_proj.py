"""The opt-in prefill-only FP8 projection GEMM (origin PR B) on CPU: gate logic, numerics of the FP8
path against bf16/fp32 math, decode unchanged, flag off == no flag bit for bit, and a logged no-op on
backends without an FP8 GEMM. (`GLM_RAY_FP8_PROJ_FORCE=1` runs the FP8 path on the torch reference.)"""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from glm_ray import LLM, SamplingParams, kernels
from glm_ray.quant.fp8_proj import Fp8ProjGemmMethod, Fp8ProjOverlay, fp8_proj_unsupported_reason
from glm_ray.quant.unquantized import Unquantized, UnquantizedLinearMethod


@pytest.fixture
def spy(monkeypatch):
    """spy() wraps the active backend's FP8 GEMM and returns the list of M it is called with.
    NOTE: call it after building an engine (engine start-up re-resolves the backend)."""
    def install():
        calls = []
        base = kernels.ops()

        def counting(x, *a, **kw):
            calls.append(x.shape[0])
            return base.block_fp8_linear(x, *a, **kw)
        monkeypatch.setattr(kernels, "_ACTIVE", dataclasses.replace(base, block_fp8_linear=counting))
        return calls
    return install


def _layer(n=256, k=384, seed=0):
    from glm_ray.layers.linear import ReplicatedLinear
    m = Fp8ProjGemmMethod(UnquantizedLinearMethod(), min_tokens=512)

    class QC(Unquantized):
        def get_method(self, layer, prefix):
            return m
    layer = ReplicatedLinear(k, n, quant_config=QC(), prefix="model.layers.0.self_attn.q_b_proj",
                             params_dtype=torch.float32)
    layer.weight.data.copy_(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k ** -0.5)
    m.process_weights_after_loading(layer)
    return layer


def test_gate_512_bf16_513_fp8(spy):
    layer = _layer()
    spy = spy()
    x = torch.randn(513, 384)
    y512 = layer(x[:512])
    assert spy == [] and torch.equal(y512, torch.nn.functional.linear(x[:512], layer.weight))
    layer(x)
    assert spy == [513]


def test_both_paths_write_into_out(spy):
    """`layer(x, out)`: the bf16 GEMM (<= 512 tokens) and the FP8 one (> 512) write `out` and equal `layer(x)`."""
    layer = _layer()
    spy = spy()
    x = torch.randn(513, 384, generator=torch.Generator().manual_seed(4))
    for rows in (512, 513):
        want = layer(x[:rows])
        store = torch.full((rows + 3, 256), float("nan"))
        got = layer(x[:rows], store[1:rows + 1])
        assert got.data_ptr() == store[1].data_ptr() and torch.equal(store[1:rows + 1], want)
        assert store[0].isnan().all() and store[rows + 1:].isnan().all()
    assert spy == [513, 513]


def test_fp8_path_within_bound_of_exact_math():
    """e4m3 keeps 3 mantissa bits: |rounding| <= 2^-4 relative per element for x and w (power-of-two
    block scales add at most a factor 2 on the step). Random rounding errors average out over K=384,
    so the relative Frobenius error of y is a few percent; we bound it at 6% (observed ~3.3%)."""
    layer = _layer()
    x = torch.randn(1024, 384)
    y = layer(x)
    ref = x @ layer.weight.T
    rel = (y - ref).norm() / ref.norm()
    assert 1e-3 < rel < 0.06, rel                       # > 1e-3: it really is the quantized path
    # the private copy has power-of-two (UE8M0) scales and the bf16 weight is untouched
    s = layer._fp8_proj_scale
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    assert layer._fp8_proj_weight.dtype == torch.float8_e4m3fn and layer.weight.dtype == torch.float32


def test_only_q_b_and_o_proj_and_only_unquantized():
    ov = Fp8ProjOverlay(Unquantized(), force=True)
    from glm_ray.layers.linear import ReplicatedLinear
    dummy = object.__new__(ReplicatedLinear)
    def pick(p):
        return type(ov.get_method(dummy, p)).__name__
    assert pick("model.layers.3.self_attn.q_b_proj") == "Fp8ProjGemmMethod"
    assert pick("model.layers.3.self_attn.o_proj") == "Fp8ProjGemmMethod"
    for other in ("model.layers.3.self_attn.kv_b_proj", "model.layers.3.self_attn.q_a_proj",
                  "model.layers.3.mlp.down_proj", "model.layers.3.self_attn.indexer.wq_b"):
        assert pick(other) == "UnquantizedLinearMethod"


def test_hybrid_model_only_mla_layers(monkeypatch, tmp_path):
    """GLM-5.3-Flash: the MLA layers' q_b_proj / o_proj take the FP8 path; a KDA layer's o_proj
    (also `self_attn.o_proj`) does not — the flag is about the MLA projections only."""
    from glm_ray.model.tiny import bundled_config, write_tiny
    from glm_ray.quant.fp8_proj import Fp8ProjGemmMethod
    path = write_tiny(tmp_path / "flash", bundled_config("glm53-flash-tiny-text.json"))
    monkeypatch.setenv("GLM_RAY_FP8_PROJ_FORCE", "1")
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=16 << 20, fp8_proj_gemm=True)
    layers = llm.engine.executor.worker.model.model.language_model.layers
    assert type(layers[3].self_attn.q_b_proj.quant_method) is Fp8ProjGemmMethod           # MLA
    assert type(layers[3].self_attn.o_proj.quant_method) is Fp8ProjGemmMethod
    assert type(layers[0].self_attn.o_proj.quant_method) is UnquantizedLinearMethod       # KDA


def test_unsupported_backend_is_logged_noop(tiny_dir, caplog, monkeypatch):
    monkeypatch.delenv("GLM_RAY_FP8_PROJ_FORCE", raising=False)
    assert fp8_proj_unsupported_reason(kernels.ops()) is not None          # torch reference on CPU
    with caplog.at_level(logging.WARNING, logger="glm_ray.quant.fp8_proj"):
        llm = LLM(tiny_dir, dtype="float32", kv_cache_memory_bytes=16 << 20, fp8_proj_gemm=True)
    assert "fp8_proj_gemm requested but not applied" in caplog.text
    attn = llm.engine.executor.worker.model.model.layers[0].self_attn
    assert type(attn.q_b_proj.quant_method) is UnquantizedLinearMethod


def _prompt_lps(llm, prompts, max_tokens=6):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2,
                                       prompt_logprobs=2), use_tqdm=False)
    return [(o.prompt_logprobs, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def test_flag_off_is_bitwise_no_flag_and_decode_unchanged_with_flag_on(tiny_dir, monkeypatch, spy):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 1000, (n,), generator=g).tolist() for n in (20, 100)]
    kw = dict(dtype="float32", kv_cache_memory_bytes=16 << 20)
    plain = _prompt_lps(LLM(tiny_dir, **kw), prompts)
    off = _prompt_lps(LLM(tiny_dir, fp8_proj_gemm=False, **kw), prompts)
    assert plain == off                                              # exact equality, not a tolerance
    monkeypatch.setenv("GLM_RAY_FP8_PROJ_FORCE", "1")
    llm = LLM(tiny_dir, fp8_proj_gemm=True, **kw)
    calls = spy()
    assert isinstance(llm.engine.executor.worker.model.model.layers[0].self_attn.q_b_proj.quant_method,
                      Fp8ProjGemmMethod)
    on = _prompt_lps(llm, prompts)                                   # every batch has <= 512 tokens
    assert on == plain and calls == []                               # -> bf16 throughout, bit for bit


def test_long_prefill_takes_fp8_path(tiny_dir, monkeypatch, spy):
    monkeypatch.setenv("GLM_RAY_FP8_PROJ_FORCE", "1")
    llm = LLM(tiny_dir, dtype="float32", kv_cache_memory_bytes=16 << 20, fp8_proj_gemm=True,
              max_num_batched_tokens=2048)
    spy = spy()
    prompt = torch.randint(10, 1000, (700,), generator=torch.Generator().manual_seed(1)).tolist()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    L = llm.engine.model_cfg.num_hidden_layers
    assert spy.count(700) == 2 * L                   # q_b_proj + o_proj of every layer in the prefill
    assert len(spy) == 2 * L                         # and nothing during the 3 decode steps
    assert len(out.outputs[0].token_ids) == 4


def test_threshold_is_configurable_from_cli_to_layer(tiny_dir, monkeypatch, spy):
    from glm_ray.cli import build_parser
    from glm_ray.serve.args import ServeArgs
    for cmd in ("serve", "generate"):
        a = build_parser().parse_args([cmd, "--fp8-proj-gemm", "--fp8-proj-min-tokens", "100"])
        assert (a.fp8_proj_gemm, a.fp8_proj_min_tokens) == (True, 100)
    from glm_ray.serve.args import APP, ENGINE, values_from_flags
    ns = build_parser().parse_args(["serve"])           # flags default to "not given": ServeArgs decides
    assert ServeArgs.from_dict(values_from_flags(ns, (ENGINE, APP))).fp8_proj_min_tokens == 512
    with pytest.raises(ValueError, match="fp8_proj_min_tokens"):
        ServeArgs.from_dict({"fp8_proj_min_tokens": -1})
    with pytest.raises(ValueError, match="fp8_proj_min_tokens"):
        LLM(tiny_dir, fp8_proj_gemm=True, fp8_proj_min_tokens=-1)
    monkeypatch.setenv("GLM_RAY_FP8_PROJ_FORCE", "1")
    llm = LLM(tiny_dir, dtype="float32", kv_cache_memory_bytes=16 << 20, fp8_proj_gemm=True,
              fp8_proj_min_tokens=100)
    calls = spy()
    g = torch.Generator().manual_seed(2)
    for n in (100, 101):                              # the gate is M > min_tokens, as at 512
        llm.generate([{"prompt_token_ids": torch.randint(10, 1000, (n,), generator=g).tolist()}],
                     SamplingParams(max_tokens=1), use_tqdm=False)
    assert set(calls) == {101} and len(calls) == 2 * llm.engine.model_cfg.num_hidden_layers
