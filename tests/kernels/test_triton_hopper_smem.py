"""Triton kernels whose software-pipelined loops hold large tiles, compiled ahead of time for sm_90 (Triton's own
ptxas, no GPU needed) to check that the launch configuration the wrapper uses fits the H100/H200's shared memory.
The interpreter tests cannot see this: session 36's first GPU run of `kda_chunk_scan` failed with OutOfResources
(Triton's default 3 stages asked 272 KiB at GLM-5.3-Flash's shapes)."""
from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.runtime.jit import JITFunction  # noqa: E402

from glm_ray.kernels.cuda import kda  # noqa: E402

HOPPER_SMEM = 232448          # bytes a block may opt into on sm_90 (227 KiB)


def _compile_sm90(kernel, signature: dict, constexprs: dict, **options):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = JITFunction(getattr(kernel, "fn", kernel))     # the raw function: under TRITON_INTERPRET the module's
    src = ASTSource(fn, signature, constexprs=constexprs)  # kernel object is an interpreter wrapper
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except (FileNotFoundError, RuntimeError) as e:      # no ptxas in this Triton build
        if "ptxas" in str(e):
            pytest.skip(f"cannot compile for sm_90 here: {e}")
        raise


def test_kda_scan_fits_hopper_shared_memory():
    """GLM-5.3-Flash's chunk 64, dk 128, the value tile and warps/stages kda_chunk_scan launches with."""
    ptr, i32 = "*fp32", "i32"
    sig = {"w_ptr": ptr, "u0_ptr": ptr, "qd_ptr": ptr, "p_ptr": ptr, "kd_ptr": ptr, "dec_ptr": ptr, "s_ptr": ptr,
           "o_ptr": ptr, "M": i32, "DV": i32, "o_sn": i32, "o_sm": i32,
           "C": "constexpr", "DK": "constexpr", "BV": "constexpr", "PREC": "constexpr"}
    k = _compile_sm90(kda._kda_scan_kernel, sig, {"C": 64, "DK": 128, "BV": kda.SCAN_BV, "PREC": "tf32x3"},
                      num_warps=kda.SCAN_WARPS, num_stages=kda.SCAN_STAGES)
    assert 0 < k.metadata.shared <= HOPPER_SMEM, k.metadata.shared



_FRESH_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from glm_ray.kernels.cuda import topk
chunk, warps = int(sys.argv[1]), int(sys.argv[2])
sig = {"s_ptr": "*fp32", "len_ptr": "*i32", "o_ptr": "*i32", "N": "i32", "K": "i32", "WORDS": "i32",
       "stride_s": "i32", "stride_o": "i32", "CHUNK": "constexpr"}
try:
    k = triton.compile(ASTSource(topk._topk_bits_kernel, sig, constexprs={"CHUNK": chunk}),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
except (FileNotFoundError, RuntimeError) as e:
    if "ptxas" not in str(e):
        raise
    print(json.dumps({"skip": str(e)}))
    raise SystemExit(0)
print(json.dumps({"shared": k.metadata.shared}))
"""


def test_topk_bits_compiles_for_hopper():
    """`topk_bits`' kernel at the chunk and warps it launches with compiles for sm_90 (Triton's own ptxas) and its
    scans and histograms fit shared memory (a launch past it fails: OutOfResources). Compiled in a fresh process:
    under TRITON_INTERPRET (this suite's CPU mode) the kernel's @jit helpers are interpreter objects."""
    import json
    import os
    import subprocess
    import sys

    from glm_ray.kernels.cuda import topk
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", _FRESH_COMPILE, str(topk.BITS_CHUNK), str(topk.BITS_WARPS)], env=env,
                       capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    if "skip" in m:
        pytest.skip(f"cannot compile for sm_90 here: {m['skip']}")
    assert m["shared"] <= HOPPER_SMEM, m
