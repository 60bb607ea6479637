"""Triton kernels whose software-pipelined loops hold large tiles, compiled ahead of time for sm_90 (Triton's own
ptxas, no GPU needed) to check that the launch configuration the wrapper uses fits the H100/H200's shared memory.
The interpreter tests cannot see this: session 36's first GPU run of `kda_chunk_scan` failed with OutOfResources
(Triton's default 3 stages asked 272 KiB at GLM-5.3-Flash's shapes).

Each kernel compiles in a fresh process with TRITON_INTERPRET=0: under the interpreter (this suite's CPU mode)
a kernel module's @jit helpers are interpreter objects, and an interpreted launch earlier in the session can
leave `triton.language` bound to the interpreter's builder (a fresh-clone CI run failed this way in session 41:
"'value' object has no attribute 'dtype'" inside `tl.arange`, the test passing alone)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

HOPPER_SMEM = 232448          # bytes a block may opt into on sm_90 (227 KiB)

# argv: module, kernel, signature (json), constexprs (json), options (json) -> {"shared": bytes} or {"skip": why}
_FRESH_COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
mod, name, sig, const, opts = sys.argv[1], sys.argv[2], *map(json.loads, sys.argv[3:6])
kernel = getattr(importlib.import_module(mod), name)
try:
    k = triton.compile(ASTSource(kernel, sig, constexprs=const), target=GPUTarget("cuda", 90, 32), options=opts)
except (FileNotFoundError, RuntimeError) as e:       # no ptxas in this Triton build
    if "ptxas" not in str(e):
        raise
    print(json.dumps({"skip": str(e)}))
    raise SystemExit(0)
print(json.dumps({"shared": k.metadata.shared}))
"""


def _shared_bytes(module: str, kernel: str, signature: dict, constexprs: dict, **options) -> int:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    args = [module, kernel, json.dumps(signature), json.dumps(constexprs), json.dumps(options)]
    r = subprocess.run([sys.executable, "-c", _FRESH_COMPILE, *args], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    if "skip" in m:
        pytest.skip(f"cannot compile for sm_90 here: {m['skip']}")
    return m["shared"]


def test_kda_scan_fits_hopper_shared_memory():
    """GLM-5.3-Flash's chunk 64, dk 128, the value tile and warps/stages kda_chunk_scan launches with."""
    from glm_ray.kernels.cuda import kda
    ptr, i32 = "*fp32", "i32"
    sig = {"w_ptr": ptr, "u0_ptr": ptr, "qd_ptr": ptr, "p_ptr": ptr, "kd_ptr": ptr, "dec_ptr": ptr, "s_ptr": ptr,
           "o_ptr": ptr, "M": i32, "DV": i32, "o_sn": i32, "o_sm": i32,
           "C": "constexpr", "DK": "constexpr", "BV": "constexpr", "PREC": "constexpr"}
    shared = _shared_bytes("glm_ray.kernels.cuda.kda", "_kda_scan_kernel", sig,
                           {"C": 64, "DK": 128, "BV": kda.SCAN_BV, "PREC": "tf32x3"},
                           num_warps=kda.SCAN_WARPS, num_stages=kda.SCAN_STAGES)
    assert 0 < shared <= HOPPER_SMEM, shared


def test_topk_bits_compiles_for_hopper():
    """`topk_bits`' kernel at the chunk and warps it launches with compiles for sm_90 (Triton's own ptxas) and its
    scans and histograms fit shared memory (a launch past it fails: OutOfResources)."""
    from glm_ray.kernels.cuda import topk
    sig = {"s_ptr": "*fp32", "len_ptr": "*i32", "o_ptr": "*i32", "N": "i32", "K": "i32", "WORDS": "i32",
           "stride_s": "i32", "stride_o": "i32", "CHUNK": "constexpr"}
    shared = _shared_bytes("glm_ray.kernels.cuda.topk", "_topk_bits_kernel", sig, {"CHUNK": topk.BITS_CHUNK},
                           num_warps=topk.BITS_WARPS)
    assert shared <= HOPPER_SMEM, shared


def _moe_up_shared(persistent: bool, stages: int, **options) -> int:
    bm, bk = 64, 128
    sig = {"a_ptr": f"tensordesc<fp8e4nv[{bm}, {bk}]>", "as_ptr": "*fp32", "w_ptr": f"tensordesc<fp8e4nv[2, 128, {bk}]>",
           "ws_ptr": "*fp32", "o_ptr": "*fp8e4nv", "os_ptr": "*fp32", "eid_ptr": "*i32", "npost_ptr": "*i32",
           **dict.fromkeys(["EM", "K", "N", "HALF", "SHALF", "stride_am", "stride_we", "stride_wn", "stride_wse",
                            "stride_wsn", "stride_om"], "i32"), "limit": "fp32", "eps": "fp32", "fmax": "fp32"}
    const = dict(UE8M0=False, HAS_LIMIT=False, INTERP=False, TMA=True, EVEN_K=True, EVEN_N=True,
                 PERSISTENT=persistent, BM=bm, BK=bk, KB=16, GROUP_M=8)
    sig.update(dict.fromkeys(const, "constexpr"))
    return _shared_bytes("glm_ray.kernels.cuda.moe_prefill", "_up_kernel", sig, const, num_warps=8,
                         num_stages=stages, **options)


def test_moe_prefill_up_two_ctas_an_sm():
    """The prefill MoE's gate/up kernel with 2 stages and a 128-register cap (`bench.moe_prefill` config
    `64:256:128:128:8:8:2:tma:r128`): it compiles for sm_90 and two CTAs' shared memory fit one SM (with 3 stages
    one CTA takes 120 KiB)."""
    shared = _moe_up_shared(False, 2, maxnreg=128)
    assert 2 * shared <= HOPPER_SMEM, shared


@pytest.mark.parametrize("stages", [2, 3])
def test_moe_prefill_up_persistent_fits_hopper(stages):
    """The persistent form (`TileConfig.persistent`, `bench.moe_prefill` `:p1`) at its sweep's stage counts: its
    epilogue's layout exchange no longer shares the pipeline's buffers (184 KiB at 3 stages, sm_90a, Triton 3.6)."""
    assert _moe_up_shared(True, stages) <= HOPPER_SMEM


@pytest.mark.parametrize("n", [32, 64, 256])
def test_fp32_linear_split_fits_hopper(n):
    """The prefill `fp32_linear` kernel (TMA tiles of x and the split weight) at the config it launches with."""
    from glm_ray.kernels.cuda.layout import fp32_linear_split_config
    bm, bn, bk, warps, stages = fp32_linear_split_config(8192, n)
    sig = {"x_desc": f"tensordesc<bf16[{bm}, {bk}]>", "w_desc": f"tensordesc<bf16[{bn}, {bk}]>", "o_ptr": "*fp32",
           "T": "i32", "N": "i32", "stride_ot": "i32", "D": "constexpr", "BM": "constexpr", "BN": "constexpr",
           "BK": "constexpr", "INTERP": "constexpr"}
    shared = _shared_bytes("glm_ray.kernels.cuda.fp32_split", "_fp32_linear_split_kernel", sig,
                           dict(D=2048, BM=bm, BN=bn, BK=bk, INTERP=False), num_warps=warps, num_stages=stages)
    assert 0 < shared <= HOPPER_SMEM, shared
