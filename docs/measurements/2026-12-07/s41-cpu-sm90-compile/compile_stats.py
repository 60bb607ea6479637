"""Registers, spill (stack) bytes, shared memory and load forms of this repo's Hopper Triton kernels, compiled for
sm_90a on a machine without a GPU (Triton's bundled ptxas + cuobjdump). Session 41 ran it with Triton 3.6.0 (the
GPU machine's version) in its own venv:

    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0 torch==2.13.0 numpy
    /tmp/t36/bin/python docs/measurements/2026-12-07/s41-cpu-sm90-compile/compile_stats.py   # from the repo root

Rows: the MLA prefill kernel (GLM-5 / glm5-flash-31b head dims: q/k 192 + 64, v 256) with pointer key tiles and
with TMA boxes, dense and sparse, at a few tile configs; the prefill MoE gate/up kernel (TMA) at 3 and 2 stages and
with a 128-register cap, one program a tile and persistent; fp32_linear's split-weight kernel at its launch configs.
Session 42 added the 64 x 64 / 8-warp MLA rows and the persistent MoE rows (compile_stats_s42.txt).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.getcwd())

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from glm_ray.kernels.cuda import fp32_split, mla_prefill, moe_prefill  # noqa: E402
from glm_ray.kernels.cuda.layout import fp32_linear_split_config  # noqa: E402

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")


def stats(kernel, sig: dict, const: dict, **options) -> str:
    sig = {**sig, **dict.fromkeys(const, "constexpr")}
    try:
        k = triton.compile(ASTSource(kernel, sig, constexprs=const), target=GPUTarget("cuda", 90, 32), options=options)
    except (RuntimeError, ValueError) as e:                                   # e.g. shared memory past the limit
        return f"error: {str(e).splitlines()[-1][:100]}"
    path = "/tmp/_compile_stats.cubin"
    with open(path, "wb") as f:
        f.write(k.asm["cubin"])
    res = subprocess.run([CUOBJDUMP, "-res-usage", path], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", res)
    ptx = k.asm["ptx"]
    return (f"regs {m.group(1):>3}  stack {m.group(2):>4} B  shared {k.metadata.shared // 1024:>3} KiB  "
            f"wgmma {ptx.count('wgmma.mma_async'):>2}  tma loads {ptx.count('cp.async.bulk.tensor'):>2}")


def mla_prefill_rows():
    m = mla_prefill
    ptrs = ["q_ptr", "tok_ptr", "kv_ptr", "pe_ptr", "bits_ptr", "o_ptr", "m_ptr", "l_ptr", "acc_ptr", "cu_q_ptr",
            "ql_ptr", "cl_ptr", "cu_k_ptr", "tile_seq_ptr", "tile_start_ptr"]
    types = ["*bf16", "*i64", "*bf16", "*bf16", "*i32", "*bf16", "*fp32", "*fp32", "*fp32"] + ["*i32"] * 6
    dn1, dn2, bdn2 = m._dn_split(192)
    for tma in (False, True):
        for sparse in (False, True):
            for bm, bn, w, s in ((128, 64, 8, 2), (64, 64, 4, 2), (64, 64, 8, 2)):
                sig = dict(zip(ptrs, types))
                descs = {"k1_desc": f"tensordesc<bf16[{bn}, {dn1}]>", "k2_desc": f"tensordesc<bf16[{bn}, {bdn2}]>",
                         "v_desc": f"tensordesc<bf16[{bn}, 256]>", "pe_desc": f"tensordesc<bf16[{bn}, 64]>"}
                const = dict(DN1=dn1, DN2=dn2, BLOCK_DN2=bdn2, DR=64, BLOCK_DR=64, DV=256, BLOCK_DV=256, BLOCK_M=bm,
                             BLOCK_N=bn, SPARSE=sparse, SKIP_EMPTY=False, BNW=max(1, bn // 32), TMA=tma, FIRST=True,
                             LAST=True, HEAD_GROUP=1, INTERP=False)
                if tma:
                    sig.update(descs)
                else:
                    const.update(dict.fromkeys(descs))
                sig.update(dict.fromkeys(["H", "K0", "K1", "WORDS"], "i32"), qk_scale="fp32")
                sig.update(dict.fromkeys(["stride_qt", "stride_qh", "stride_kvn", "stride_kvh", "stride_pe",
                                          "stride_ot", "stride_oh"], "i32"))
                name = f"mla_prefill {'sparse' if sparse else 'dense':6s} {'tma ' if tma else 'ptr '} {bm}x{bn} w{w} s{s}"
                print(f"{name:40s} {stats(m._prefill_kernel, sig, const, num_warps=w, num_stages=s)}", flush=True)


def moe_up_rows():
    m = moe_prefill
    bm, bk = 64, 128
    sig = {"a_ptr": f"tensordesc<fp8e4nv[{bm}, {bk}]>", "as_ptr": "*fp32",
           "w_ptr": f"tensordesc<fp8e4nv[2, 128, {bk}]>", "ws_ptr": "*fp32", "o_ptr": "*fp8e4nv", "os_ptr": "*fp32",
           "eid_ptr": "*i32", "npost_ptr": "*i32",
           **dict.fromkeys(["EM", "K", "N", "HALF", "SHALF", "stride_am", "stride_we", "stride_wn", "stride_wse",
                            "stride_wsn", "stride_om"], "i32"), "limit": "fp32", "eps": "fp32", "fmax": "fp32"}
    for persistent in (False, True):
        const = dict(UE8M0=False, HAS_LIMIT=False, INTERP=False, TMA=True, EVEN_K=True, EVEN_N=True,
                     PERSISTENT=persistent, BM=bm, BK=bk, KB=16, GROUP_M=8)
        for s, regs in ((3, None), (2, None), (2, 128)):
            opts = {"num_warps": 8, "num_stages": s, **({"maxnreg": regs} if regs else {})}
            name = f"moe_prefill up{' pers' if persistent else ''} 64x256 w8 s{s} maxnreg {regs}"
            print(f"{name:40s} {stats(m._up_kernel, sig, const, **opts)}", flush=True)


def fp32_split_rows():
    m = fp32_split
    for n in (32, 64, 256):
        bm, bn, bk, w, s = fp32_linear_split_config(8192, n)
        sig = {"x_desc": f"tensordesc<bf16[{bm}, {bk}]>", "w_desc": f"tensordesc<bf16[{bn}, {bk}]>", "o_ptr": "*fp32",
               "T": "i32", "N": "i32", "stride_ot": "i32"}
        const = dict(D=2048, BM=bm, BN=bn, BK=bk, INTERP=False)
        print(f"{f'fp32_linear_split N={n} {bm}x{bn}x{bk} w{w} s{s}':40s} "
              f"{stats(m._fp32_linear_split_kernel, sig, const, num_warps=w, num_stages=s)}", flush=True)


if __name__ == "__main__":
    print(f"triton {triton.__version__}, target sm_90a")
    mla_prefill_rows()
    moe_up_rows()
    fp32_split_rows()
