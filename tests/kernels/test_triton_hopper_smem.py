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
sig = {"s_ptr": "*fp32", "len_ptr": "*i32", "o_ptr": "*i32", "c_ptr": "*i32", "N": "i32", "K": "i32",
       "WORDS": "i32", "CAP": "i32", "stride_s": "i32", "stride_o": "i32", "stride_c": "i32",
       "CHUNK": "constexpr", "COMPACT": "constexpr"}
try:
    k = triton.compile(ASTSource(topk._topk_bits_kernel, sig, constexprs={"CHUNK": chunk, "COMPACT": True}),
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


_ROWS_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from glm_ray.kernels.cuda import mla_decode, mla_rows
h, D, r = 32, 576, 512
block_h = mla_decode._config(h, D)[0]
rows = mla_rows.rows_per_tile(h, D)
_, block_n, warps, stages = mla_decode._config(rows * block_h, D)[:4]
p, i = "*bf16", "i32"
sig = {"q_ptr": p, "kv_ptr": p, "bt_ptr": "*i32", "cl_ptr": "*i32", "rf_ptr": "*i32", "idx_ptr": "*i32",
       "bits_ptr": "*i32", "o_ptr": "*fp32", "lse_ptr": "*fp32", "B": i, "H": i, "K_IDX": i, "WORDS": i,
       "qk_scale": "fp32", "stride_qb": i, "stride_qh": i, "stride_kv": i, "stride_btb": i, "stride_idxb": i,
       "stride_ob": i, "stride_oh": i, "stride_os": i}
out = {}
for sparse in (False, True):
    consts = dict(R=r, DR=D - r, BLOCK_R=512, BLOCK_DR=64, BLOCK_SIZE=64, NUM_SPLITS=2, ROWS=rows,
                  BLOCK_H=block_h, BLOCK_N=block_n, SPARSE=sparse, DIRECT=False, INTERP=False, WALK=mla_rows.WALK)
    s = {**sig, **{k: "constexpr" for k in consts}}
    s["NUM_SPLITS"] = i
    consts.pop("NUM_SPLITS")
    try:
        k = triton.compile(ASTSource(mla_rows._mla_rows_kernel, s, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    except (FileNotFoundError, RuntimeError) as e:
        if "ptxas" not in str(e):
            raise
        print(json.dumps({"skip": str(e)}))
        raise SystemExit(0)
    out[str(sparse)] = {"shared": k.metadata.shared, "rows": rows}
print(json.dumps(out))
"""


def test_mla_rows_compiles_for_hopper():
    """`mla_decode_runs`' kernel at glm5-flash-31b's shapes (h = 32: 2 rows x 32 heads a program) compiles for sm_90,
    dense and DSA, and its pipelined key tiles fit shared memory. Fresh process, as for topk_bits."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", _ROWS_COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    if "skip" in m:
        pytest.skip(f"cannot compile for sm_90 here: {m['skip']}")
    for v in m.values():
        assert v["rows"] == 2 and 0 < v["shared"] <= HOPPER_SMEM, m
