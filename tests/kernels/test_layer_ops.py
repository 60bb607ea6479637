"""The layers' attention / indexer / KDA / SwiGLU math goes through `kernels.ops()`: the ops exist in the
torch table, the cuda and aiter backends inherit the references for them, GLM_RAY_TORCH_OPS knows
their names, and a real engine run of GLM-5 and GLM-5.3-Flash calls each of them through the active
backend (a spying backend registered for the run)."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from glm_ray import LLM, SamplingParams, kernels
from glm_ray.kernels.torch_ref import attention, indexer, kda, moe
from tests.kernels import fake_aiter

NEW_OPS = {"mla_prefill": attention.mla_prefill, "mla_decode": attention.mla_decode,
           "indexer_topk": indexer.indexer_topk, "indexer_kpool_topk": indexer.indexer_kpool_topk,
           "causal_conv1d": kda.causal_conv1d_cached, "kda_chunked": kda.kda_chunked_cached,
           "kda_decode": kda.kda_decode, "swiglu": moe.swiglu}


def test_torch_table_holds_the_references():
    ops = kernels.init_backend("torch")
    for name, ref in NEW_OPS.items():
        assert getattr(ops, name) is ref, name


def test_cuda_backend_inherits_the_references(monkeypatch):
    try:
        ops = kernels.init_backend("cuda", "cpu")
        for name, ref in NEW_OPS.items():
            if name not in ("kda_decode", "kda_chunked", "mla_decode", "mla_prefill", "indexer_topk",
                            "swiglu"):                                                    # the cuda backend's own
                assert getattr(ops, name) is ref, name
        monkeypatch.setenv("GLM_RAY_TORCH_OPS", "kda_decode,kda_chunked,mla_decode,mla_prefill,indexer_topk,swiglu")
        ops = kernels.init_backend("cuda", "cpu")
        assert ops.kda_decode is kda.kda_decode and ops.mla_decode is attention.mla_decode
        assert ops.kda_chunked is kda.kda_chunked_cached
        assert ops.swiglu is moe.swiglu
        assert ops.mla_prefill is attention.mla_prefill
    finally:
        monkeypatch.delenv("GLM_RAY_TORCH_OPS", raising=False)
        kernels.init_backend("torch")


def test_aiter_backend_inherits_the_references(monkeypatch):
    """Past aiter's own ops the aiter table holds the portable Triton kernels (where triton imports),
    the torch references for the rest; GLM_RAY_TORCH_OPS pins any of them back to the reference."""
    from glm_ray.kernels.aiter.ops import triton_fallback
    from glm_ray.kernels.cuda.ops import ROCM_PORTABLE, CudaKernels
    fake_aiter.install(monkeypatch)
    has_triton = triton_fallback() is not None
    try:
        ops = kernels.init_backend("aiter")
        for name, ref in NEW_OPS.items():
            if name == "mla_decode":                                 # aiter's mla_decode_fwd (page size 1)
                continue
            fn = getattr(ops, name)
            if has_triton and name in ROCM_PORTABLE:
                assert isinstance(fn.__self__, CudaKernels) and fn.__func__ is getattr(CudaKernels, name), name
            else:
                assert fn is ref, name
        pinned = [n for n in NEW_OPS if n != "mla_decode"]
        monkeypatch.setenv("GLM_RAY_TORCH_OPS", ",".join(pinned))
        ops = kernels.init_backend("aiter")
        for name in pinned:
            assert getattr(ops, name) is NEW_OPS[name], name
    finally:
        monkeypatch.delenv("GLM_RAY_TORCH_OPS", raising=False)
        kernels.init_backend("torch")


@pytest.fixture
def spy_backend(monkeypatch):
    """A registered backend 'spy': the torch table with every op counted."""
    calls: Counter = Counter()

    def wrap(name, fn):
        def spy(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return spy

    def factory():
        base = kernels._torch_ops()
        return dataclasses.replace(base, name="spy", **{n: wrap(n, getattr(base, n)) for n in NEW_OPS})
    monkeypatch.setitem(kernels._REGISTRY, "spy", factory)
    yield calls
    kernels.init_backend("torch")


def _run(path, lengths, **kw):
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 1000, (n,), generator=g).tolist()} for n in lengths]
    llm = LLM(path, dtype="float32", kernel_backend="spy", kv_cache_memory_bytes=32 << 20, **kw)
    llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)


def test_glm5_layers_call_the_ops(tiny_dir, spy_backend):
    _run(tiny_dir, (30, 12))                                     # longer than index_topk: DSA scores
    for name in ("mla_prefill", "mla_decode", "indexer_topk", "swiglu"):
        assert spy_backend[name] > 0, (name, spy_backend)


def test_glm53_flash_layers_call_the_ops(tmp_path, spy_backend):
    pytest.importorskip("transformers.models.glm5_next")
    from tests.flash_tiny import write_flash_tiny
    _run(write_flash_tiny(tmp_path / "flash"), (30, 12))
    for name in ("mla_prefill", "mla_decode", "indexer_kpool_topk", "causal_conv1d", "kda_chunked", "kda_decode",
                 "swiglu"):
        assert spy_backend[name] > 0, (name, spy_backend)


@pytest.mark.skipif(torch.cuda.is_available(), reason="fake streams: torch.cuda.stream() is a no-op only without CUDA")
def test_forked_waits_for_the_main_stream_and_join_for_the_side(monkeypatch):
    """kernels/streams.forked / join, the side-stream fork of MoE and MLA decode layers: the side stream
    waits for the main stream's work before the forked block runs (on the side lane), the main stream
    waits for the side stream at the join (fake streams record the order)."""
    from glm_ray.kernels import streams
    log = []

    class FakeStream:
        def __init__(self, name):
            self.name, self.device = name, torch.device("cpu")

        def wait_stream(self, other):
            log.append(f"{self.name} waits for {other.name}")

    main, side = FakeStream("main"), FakeStream("side")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    with streams.forked(side):
        log.append(f"block on lane {streams.lane()}")
    assert streams.lane() == 0
    streams.join(side)
    assert log == ["side waits for main", "block on lane 1", "main waits for side"]


def test_stream_lanes_and_no_side_stream_off_gpu():
    """kernels/streams.py: the lane is 1 only inside `on_side` (nested and restored after errors); a CPU
    tensor never gets a side stream, whatever the limit."""
    from glm_ray.kernels import streams
    assert streams.lane() == 0
    with streams.on_side(None):                                  # torch.cuda.stream(None) is a no-op
        assert streams.lane() == 1
        with streams.on_side(None):
            assert streams.lane() == 1
        assert streams.lane() == 1
    assert streams.lane() == 0
    try:
        with streams.on_side(None):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert streams.lane() == 0
    assert streams.side_stream_for(torch.zeros(4, 8), 64) is None
