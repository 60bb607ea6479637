"""The aiter backend's Triton fallback (#18 item 5: what aiter has no op for runs the Triton kernels), on CPU.

Checked: the aiter table takes aiter's ops first, then the cuda backend's portable Triton ops
(`cuda.ops.ROCM_PORTABLE`), then the torch reference; the shapes aiter's own kernels refuse (mla_decode,
moe_routing) reach the Triton op, not the reference directly; on a HIP build of torch the portable ops pass
the device check with no capability query (gfx950 reports (9, 5)) and the NVIDIA-only ones do not; the
kernel modules of the portable ops contain none of the constructs that only compile for NVIDIA (the scan is
shown to find them in the modules that have them); and, under TRITON_INTERPRET=1, ops of the aiter table
run the Triton kernels and equal the torch reference. What this cannot check: that the kernels compile and
are fast on an MI355X (no AMD GPU here) — their tile configs are Hopper's.
"""
from __future__ import annotations

import ast
import os
import sys
import types
from dataclasses import fields
from pathlib import Path

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")      # CPU-only: build every triton kernel interpreted

pytest.importorskip("triton")

from glm_ray import kernels  # noqa: E402
from glm_ray.kernels.aiter.ops import AiterKernels, make_ops  # noqa: E402
from glm_ray.kernels.cuda.ops import ROCM_PORTABLE, CudaKernels  # noqa: E402
from glm_ray.kernels.table import KernelOps  # noqa: E402
from glm_ray.kernels.torch_ref import attention  # noqa: E402
from glm_ray.kernels.torch_ref.norm import rms_norm as ref_rms_norm  # noqa: E402
from tests.kernels import fake_aiter  # noqa: E402

CUDA_DIR = Path(kernels.__file__).parent / "cuda"
AITER_OWN = {"block_fp8_linear", "block_fp8_linear_prepare", "moe_quant_layout", "moe_quant_prepare",
             "fused_moe_block_fp8", "fused_moe_mxfp4", "mla_decode", "moe_routing"}
# source constructs that compile for NVIDIA only: TMA descriptors, PDL / libdevice under tl.extra.cuda, the
# `.cg` cache modifier, inline PTX, cuBLASLt's blockwise FP8 GEMM
NVIDIA_ONLY = ("tensor_descriptor", "TensorDescriptor", "tl.extra.cuda", "launch_pdl", '".cg"', "inline_asm",
               "_scaled_mm(")


@pytest.fixture
def aiter_backend(monkeypatch):
    fake_aiter.install(monkeypatch)
    ops = kernels.init_backend("aiter")
    yield ops
    kernels.init_backend("torch")


def _owner(fn) -> str:
    self = getattr(fn, "__self__", None)
    return type(self).__name__ if self is not None else "torch"


def test_aiter_table_is_aiter_then_triton_then_torch(aiter_backend):
    base = kernels._torch_ops()
    for f in fields(KernelOps):
        if f.name == "name":
            continue
        fn = getattr(aiter_backend, f.name)
        if f.name in AITER_OWN:
            assert _owner(fn) == "AiterKernels", f.name
        elif f.name in ROCM_PORTABLE:
            assert _owner(fn) == "CudaKernels" and fn.__self__.name == "aiter", f.name
        else:
            assert fn is getattr(base, f.name), f.name                  # no kernel anywhere: the reference
    assert {"mla_prefill", "indexer_topk", "fused_moe", "rms_norm"} <= set(ROCM_PORTABLE) - AITER_OWN


def test_aiter_without_triton_inherits_the_reference(monkeypatch):
    fake_aiter.install(monkeypatch)
    table = make_ops(fake_aiter, triton=None)
    assert table.mla_prefill is None and table.fused_moe is None and table.rms_norm is None
    assert _owner(table.mla_decode) == "AiterKernels" and table.mla_decode.__self__.triton is None


def _cuda_like():
    return types.SimpleNamespace(device=torch.device("cuda", 0))


def test_device_check_on_rocm(monkeypatch):
    k = CudaKernels(name="aiter")

    def no_capability(device):
        raise AssertionError("capability() asked on ROCm")
    monkeypatch.setattr(k, "capability", no_capability)
    monkeypatch.setattr(torch.version, "hip", "6.4")
    for op in ROCM_PORTABLE:
        assert k._gpu_reason(_cuda_like(), 90, True, op) is None, op
    for op in ("block_fp8_linear", "fused_moe_block_fp8"):
        assert "NVIDIA-only" in k._gpu_reason(_cuda_like(), 90, True, op)
    assert "needs a GPU" in k._gpu_reason(torch.zeros(1), 80, True, "rms_norm")
    # CUDA: the capability decides, for every op
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(k, "capability", lambda device: (8, 0))
    assert k._gpu_reason(_cuda_like(), 80, True, "rms_norm") is None
    assert k._gpu_reason(_cuda_like(), 90, True, "block_fp8_linear") == "sm_80 < sm_90"


def _nvidia_only(module: str) -> list[str]:
    src = (CUDA_DIR / f"{module}.py").read_text()
    return [c for c in NVIDIA_ONLY if c in src]


def _cuda_imports(module: str) -> set[str]:
    """The glm_ray.kernels.cuda modules `module` imports (any level)."""
    tree = ast.parse((CUDA_DIR / f"{module}.py").read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "glm_ray.kernels.cuda":
                out |= {a.name for a in node.names}
            elif node.module.startswith("glm_ray.kernels.cuda."):
                out.add(node.module.rsplit(".", 1)[1])
    return out


def test_portable_modules_have_no_nvidia_only_constructs():
    assert _nvidia_only("fp8_small_m") and _nvidia_only("moe_prefill")   # the scan finds what is there
    for op, modules in ROCM_PORTABLE.items():
        for m in modules:
            assert not _nvidia_only(m), (op, m, _nvidia_only(m))
            # every kernel module a portable module imports is listed for its op (layout is pure torch)
            assert _cuda_imports(m) - {"layout"} <= set(modules), (op, m, _cuda_imports(m))


def test_aiter_refusals_reach_the_triton_op(aiter_backend):
    """A bool-mask selection (which aiter's MLA decode does not take) goes to the Triton op; on CPU that op
    then runs the reference itself — counted in its `fallbacks`, which is how the route shows here."""
    from tests.kernels.test_aiter_backend import _mla_decode_inputs, _ref_mla_decode
    t = aiter_backend.mla_prefill.__self__
    q, cache, group = _mla_decode_inputs(16)
    mask = group.causal.clone()
    mask[:, :, 1::2] = False
    mask[:, :, 0] = True
    out = aiter_backend.mla_decode(q, cache, group, mask, kv_lora_rank=512, scale=0.05)
    torch.testing.assert_close(out, _ref_mla_decode(q, cache, group, mask, 0.05), rtol=0, atol=0)
    assert sum(n for (op, _), n in t.fallbacks.items() if op == "mla_decode") == 1
    logits = torch.randn(5, 32)
    aiter_backend.moe_routing(logits, None, top_k=4, n_group=4, topk_group=2, renormalize=True, scale=1.0)
    assert sum(n for (op, _), n in t.fallbacks.items() if op == "moe_routing") == 1
    assert isinstance(aiter_backend.mla_decode.__self__, AiterKernels)


@pytest.fixture
def interpreted_aiter(aiter_backend, monkeypatch):
    """The aiter table with its Triton ops let through the device check: CPU tensors, interpreted kernels."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (a CPU run)")
    t = aiter_backend.mla_prefill.__self__
    monkeypatch.setattr(t, "_gpu_reason", lambda *a, **k: None)
    return aiter_backend, t


def test_aiter_table_runs_triton_rms_norm(interpreted_aiter):
    ops, t = interpreted_aiter
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    r = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(torch.bfloat16)
    y, s = ops.rms_norm(x, w, 1e-6, r)
    y_ref, s_ref = ref_rms_norm(x, w, 1e-6, r)
    assert torch.equal(s, s_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-2, atol=1e-2)
    assert not t.fallbacks and not t.broken                     # the kernel ran, not the reference


def test_aiter_table_runs_triton_mla_prefill(interpreted_aiter):
    from tests.kernels.test_mla_prefill_triton import make_step, rel_err
    ops, t = interpreted_aiter
    step = make_step([5, 3], [5, 9], 4, dn=32, dr=16, dv=16, dtype=torch.bfloat16)
    q, cache, w = step["q"], step["kv_cache"], step["w"]
    (group,) = [g for g in step["groups"] if g.mla_mode == "naive"]
    kw = dict(kv_lora_rank=32, v_head_dim=16, scale=0.1, max_bytes=1 << 30)

    def kv_b(x):
        return x @ w.T
    out = ops.mla_prefill(q, cache, group, None, kv_b, **kw)
    ref = attention.mla_prefill(q.float(), cache.float(), group, None, lambda x: x @ w.float().T, **kw)
    assert rel_err(out, ref) < 2e-2
    assert not t.fallbacks and not t.broken
