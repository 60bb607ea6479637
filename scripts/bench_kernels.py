#!/usr/bin/env python3
"""Microbenchmark of the `cuda` backend's kernels on one NVIDIA GPU (H200 ceilings by default).

Dense projections (glm5-slice-6l q_b_proj 16384x2048 and o_proj 6144x16384) at M = 256..16384:
  bf16      F.linear(x, W) in bf16
  fp8       the backend's block_fp8_linear: 1x128 activation quant (Triton) + torch._scaled_mm blockwise
  fp8_gemm  torch._scaled_mm alone on pre-quantized operands (the GEMM's share)
  fp8_triton  the Triton block-FP8 GEMM (GLM_RAY_CUDA_FP8_GEMM=triton) at a few M
Fused MoE (glm5-flash-31b experts: 64 x (2048 <-> 1536), top-4) at a few token counts: bf16 / fp8 / mxfp4.
Small-M block-FP8 (`--small-m`, replaces the tables above): every dense projection of glm5-flash-31b and
glm5-slice-6l at M = 1..64 (decode), three variants, each timed as ONE CUDA-graph replay (what a decode
step pays: no host launch cost, the in-graph gaps between launches included), L2 flushed before each:
  fused    fp8_small_m.block_fp8_linear_small_m (activation quant fused into the GEMM, + split-K sum)
  backend  the backend's block_fp8_linear on the prepared weight: act_quant_fp8 + torch._scaled_mm
  triton   act_quant_fp8 + the Triton block-FP8 GEMM (dense_gemm_triton), as GLM_RAY_CUDA_FP8_GEMM=triton
  TB/s there = weight bytes (e4m3 + fp32 block scales) / time, with the ratio to the 4.2 TB/s copy ceiling.
Small-M tile sweep (`--small-m-sweep`): the fused kernel's configs (BN x warps x split-K, split-K partials
added by the last program or by a second launch) and the backend path at the glm5-flash-31b decode shapes,
M in {1, 16, 64}, each timed as R back-to-back calls on R distinct weight copies (R x bytes >= 3 x L2) in one
CUDA graph, per call: what a decode step pays (in-graph launch gaps included, weights from HBM).
`--small-m-pdl`: the same chains with the fused kernel launched as programmatic dependent launches or not.
`--decode-small-ops`: the decode step's router GEMM (`fp32_linear`) and SwiGLU (`swiglu`) Triton launches vs
the torch ops they replace, CUDA-graph replays at T = 1..256, glm5-flash-31b and GLM-5 shapes.
`--prefill-fp32-linear`: `fp32_linear` at prefill sizes (T = 512..8192): the split-weight tensor-core kernel
(`fp32_linear_split`) vs x.float() + cuBLAS's fp32 GEMM, routers and indexer head weights of both models.

Printed per row: time (us, median of triton.testing.do_bench with an L2 flush between runs),
achieved TFLOP/s and TB/s, and their ratio to the measured H200 ceilings (perf_anchors.md §3.1:
4.2 TB/s copy, ~790 TFLOP/s bf16 GEMM, ~1.2 PFLOP/s blockwise FP8). Bytes are the op's compulsory
traffic: weights once (MoE: only the experts the routing touches) + activations in + outputs out.
Writes every row as JSON to --out.

  PYTHONPATH=$PWD python3 scripts/bench_kernels.py --out /tmp/kernels.json [--quick] [--small-m]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the repo root: tests.kernels.cases

DEV = "cuda"
CEIL = {"tbps": 4.2, "bf16_tflops": 790.0, "fp8_tflops": 1200.0}
DENSE = [("slice.q_b_proj", 16384, 2048), ("slice.o_proj", 6144, 16384)]
MS = [256, 512, 1024, 2048, 4096, 8192, 16384]
MOE_GEO = dict(d=2048, i=1536, e=64, k=4)           # glm5-flash-31b routed experts
MOE_TS = [1, 2048, 8192]                            # tile configs shared with the GPU tests
SMALL_MS = [1, 2, 4, 8, 16, 32, 64]
# (name, N, K): the block-FP8 dense projections a decode step runs (MLA, indexer, shared expert, dense MLP)
SMALL_M_SHAPES = [
    ("flash.q_a_proj", 768, 2048), ("flash.kv_a_proj", 576, 2048), ("flash.q_b_proj", 8192, 768),
    ("flash.o_proj", 2048, 8192), ("flash.idx.wq_b", 4096, 768), ("flash.idx.wk", 128, 2048),
    ("flash.sh.gate_up", 3072, 2048), ("flash.sh.down", 2048, 1536),
    ("flash.mlp.gate_up", 20480, 2048), ("flash.mlp.down", 2048, 10240),
    ("slice.q_a_proj", 2048, 6144), ("slice.kv_a_proj", 576, 6144), ("slice.q_b_proj", 16384, 2048),
    ("slice.o_proj", 6144, 16384), ("slice.idx.wq_b", 4096, 2048), ("slice.idx.wk", 128, 6144),
    ("slice.sh.gate_up", 4096, 6144), ("slice.sh.down", 6144, 2048),
    ("slice.mlp.gate_up", 24576, 6144), ("slice.mlp.down", 6144, 12288),
]


def bench_ms(fn) -> float:
    try:
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    except ImportError:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n = 20
        s.record()
        for _ in range(n):
            fn()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / n


def row(kind, name, variant, m, ms, flops, nbytes, peak_tflops, **extra):
    t = ms * 1e-3
    r = {"kind": kind, "shape": name, "variant": variant, "m": m, "us": round(ms * 1e3, 2),
         "tflops": round(flops / t / 1e12, 1), "tbps": round(nbytes / t / 1e12, 3),
         "frac_flops_ceiling": round(flops / t / 1e12 / peak_tflops, 3),
         "frac_bw_ceiling": round(nbytes / t / 1e12 / CEIL["tbps"], 3), **extra}
    print(f"{kind:5s} {name:16s} {variant:10s} M={m:6d} {r['us']:9.1f} us {r['tflops']:7.1f} TF/s "
          f"({r['frac_flops_ceiling']:.0%}) {r['tbps']:6.3f} TB/s ({r['frac_bw_ceiling']:.0%})", flush=True)
    return r


def bench_dense(ck, ms, rows, triton_ms):
    from glm_ray.kernels.cuda.layout import scaled_mm_operands
    from tests.kernels.cases import dense_fp8_case
    for name, n, k in DENSE:
        _, w, s = dense_fp8_case(1, n, k, device=DEV)
        wb = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * k ** -0.5
        wv, sv, meta = ck.block_fp8_linear_prepare(w, s, (128, 128))
        wp, sp, _ = scaled_mm_operands(wv, sv, **meta)
        for m in ms:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            fl = 2.0 * m * n * k
            rows.append(row("dense", name, "bf16", m, bench_ms(lambda: F.linear(x, wb)), fl,
                            2 * n * k + 2 * m * k + 2 * m * n, CEIL["bf16_tflops"]))
            rows.append(row("dense", name, "fp8", m, bench_ms(lambda: ck.block_fp8_linear(x, wv, sv, **meta)), fl,
                            n * k + 2 * m * k + 2 * m * n, CEIL["fp8_tflops"]))
            xq, xs = ck.tk.act_quant_fp8(x, m_out=m, k_out=wp.shape[1], col_major_scale=True)
            rows.append(row("dense", name, "fp8_gemm", m, bench_ms(lambda: ck._scaled_mm(xq, xs, wp, sp)), fl,
                            n * k + m * k + 2 * m * n, CEIL["fp8_tflops"]))
            if m in triton_ms:
                xq2, xs2 = ck.tk.act_quant_fp8(x)
                rows.append(row("dense", name, "fp8_triton", m, bench_ms(
                    lambda: ck.tk.dense_gemm_triton(xq2, w, w_mode="fp8", a_scale=xs2, w_scale=s)), fl,
                    n * k + m * k + 2 * m * n, CEIL["fp8_tflops"]))


def bench_moe(ck, ts, rows, fmts):
    from tests.kernels.cases import moe_case
    g = MOE_GEO
    per_expert = 3 * g["i"] * g["d"]                                  # w13 (2I x D) + w2 (D x I) elements
    for fmt in fmts:
        c = moe_case(max(ts), g["d"], g["i"], g["e"], g["k"], fmt, device=DEV)
        wbytes = {"bf16": 2.0, "fp8": 1.0 + 4 / 16384, "mxfp4": 0.5 + 1 / 32}[fmt]
        peak = CEIL["fp8_tflops"] if fmt == "fp8" else CEIL["bf16_tflops"]
        for t in ts:
            x, tw, ids = c.x[:t], c.topk_weights[:t], c.topk_ids[:t]
            if fmt == "bf16":
                fn = lambda: ck.fused_moe(x, c.w13, c.w2, tw, ids)              # noqa: E731
            elif fmt == "fp8":
                fn = lambda: ck.fused_moe_block_fp8(x, c.w13, c.s13, c.w2, c.s2, tw, ids)   # noqa: E731
            else:
                fn = lambda: ck.fused_moe_mxfp4(x, c.w13, c.s13, c.w2, c.s2, tw, ids, act_mode="even")  # noqa: E731
            fn()
            touched = int(torch.unique(ids).numel())
            fl = 2.0 * t * g["k"] * per_expert
            nbytes = touched * per_expert * wbytes + 2 * 2 * t * g["d"]
            rows.append(row("moe", f"E{g['e']}k{g['k']}", fmt, t, bench_ms(fn), fl, nbytes, peak,
                            experts_touched=touched))
        c = fn = None                     # free this format's weights before the next one
        torch.cuda.empty_cache()


def bench_graph_ms(fn) -> float:
    """Median device time of one CUDA-graph replay of fn (warmed up and compiled outside the capture)."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return bench_ms(g.replay)


def bench_small_m(ck, ms, rows):
    """The decode-size block-FP8 table: fused small-M kernel vs the backend path vs the Triton GEMM path."""
    from glm_ray.kernels.cuda import fp8_small_m
    from tests.kernels.cases import dense_fp8_case
    tk = ck.tk
    for name, n, k in SMALL_M_SHAPES:
        _, w, s = dense_fp8_case(1, n, k, device=DEV)
        wv, sv, meta = ck.block_fp8_linear_prepare(w, s, (128, 128))
        wbytes = n * k + 4 * s.numel()
        for m in ms:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            cfg = fp8_small_m.small_m_config(m, n, k, num_sms=torch.cuda.get_device_properties(0).multi_processor_count)

            def triton_path():
                xq, xs = tk.act_quant_fp8(x)
                return tk.dense_gemm_triton(xq, wv, w_mode="fp8", a_scale=xs, w_scale=sv, out_dtype=x.dtype,
                                            n=n, k=k)
            variants = {"fused": lambda: fp8_small_m.block_fp8_linear_small_m(x, wv, sv),
                        "backend": lambda: ck.block_fp8_linear(x, wv, sv, **meta),
                        "triton": triton_path}
            got = {}
            for v, fn in variants.items():
                got[v] = bench_graph_ms(fn)
                rows.append(row("smallm", name, v, m, got[v], 2.0 * m * n * k, wbytes, CEIL["fp8_tflops"],
                                n=n, k=k, **({"split": cfg.split, "block_n": cfg.block_n} if v == "fused" else {})))
            print(f"{'':5s} {name:16s} M={m:<3d} fused split={cfg.split}: x{got['backend'] / got['fused']:.2f} vs "
                  f"backend, x{got['triton'] / got['fused']:.2f} vs triton", flush=True)
        torch.cuda.empty_cache()


# glm5-flash-31b's decode-step linears, most bytes first (q_a + kv_a run as one fused GEMM in the engine)
SWEEP_SHAPES = [("flash.o_proj", 2048, 8192), ("flash.q_b_proj", 8192, 768), ("flash.sh.gate_up", 3072, 2048),
                ("flash.idx.wq_b", 4096, 768), ("flash.sh.down", 2048, 1536), ("flash.qkv_a", 1344, 2048),
                ("flash.idx.wk", 128, 2048)]
SWEEP_MS = [1, 16, 32, 64]
L2_BYTES = 50 * 2 ** 20                      # H100/H200


def chain_reps(wbytes: int) -> int:
    """Calls per timed graph: enough distinct weight copies that they cannot stay in L2 (>= 3 x L2)."""
    return max(8, min(256, -(-3 * L2_BYTES // wbytes)))


def graph_per_call_ms(fns) -> float:
    """Median device time per call of one CUDA-graph replay of every fn in fns, in order."""
    for fn in fns[:2]:
        fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    return bench_ms(g.replay) / len(fns)


def sweep_configs(fp8_small_m, m, n, k, num_sms):
    """(label, config, reduce) candidates: the shipped config with both reductions, then BN x warps x split
    (heuristic/2, heuristic, 2x, 4x, 1) with the last-program reduction at BM 16, both reductions above."""
    auto = fp8_small_m.small_m_config(m, n, k, num_sms=num_sms)
    other = "kernel" if auto.reduce == "last" else "last"
    seen, out = {(auto, auto.reduce), (auto, other)}, [("auto", auto, auto.reduce), (f"auto/{other}", auto, other)]
    bns = (32, 64, 128) if auto.block_m <= 16 else (64, 128)
    warps = (4,) if auto.block_m <= 16 else (4, 8)
    for bn in bns:
        a = fp8_small_m.small_m_config(m, n, k, num_sms=num_sms, block_n=bn)
        for split in sorted({max(1, a.split // 2), a.split, 2 * a.split, 4 * a.split, 1}):
            c = fp8_small_m.small_m_config(m, n, k, num_sms=num_sms, block_n=bn, split_k=split)
            for nw in warps:
                for red in ("last",) if c.block_m <= 16 or c.split == 1 else ("last", "kernel"):
                    cfg = fp8_small_m.SmallMConfig(c.block_m, bn, c.split, c.groups_per_split, nw, c.num_stages,
                                                   red)
                    if (cfg, red) in seen or (dataclasses.replace(cfg, reduce=auto.reduce), red) in seen:
                        continue
                    seen.add((cfg, red))
                    out.append((f"bn{bn}/w{nw}/s{cfg.split}/{red}", cfg, red))
    return out


def bench_small_m_sweep(ck, rows, deadline):
    from glm_ray.kernels.cuda import fp8_small_m
    from tests.kernels.cases import dense_fp8_case
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, n, k in SWEEP_SHAPES:
        _, w, s = dense_fp8_case(1, n, k, device=DEV)
        wbytes = n * k + 4 * s.numel()
        reps = chain_reps(wbytes)
        meta = ck.block_fp8_linear_prepare(w, s, (128, 128))[2]
        # distinct weights (no L2 reuse), each prepared as the layers hold it (the padded corner views:
        # a plain clone of a view would be unpadded and make the backend path copy per call)
        copies = [ck.block_fp8_linear_prepare(w, s, (128, 128))[:2] for _ in range(reps)]
        for m in SWEEP_MS:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            cands = sweep_configs(fp8_small_m, m, n, k, num_sms)
            res = {}
            for label, cfg, red in cands:
                if time.time() > deadline:
                    print("sweep: out of time", flush=True)
                    return
                fns = [lambda a=a, b=b, cfg=cfg, red=red: fp8_small_m.block_fp8_linear_small_m(
                    x, a, b, config=cfg, reduce=red) for a, b in copies]
                res[label] = graph_per_call_ms(fns)
                rows.append(row("sweep", name, label, m, res[label], 2.0 * m * n * k, wbytes, CEIL["fp8_tflops"],
                                n=n, k=k, reps=reps, block_n=cfg.block_n, warps=cfg.num_warps, split=cfg.split,
                                gps=cfg.groups_per_split, reduce=red))
            fns = [lambda a=a, b=b: ck.block_fp8_linear(x, a, b, **meta) for a, b in copies]
            res["backend"] = graph_per_call_ms(fns)
            rows.append(row("sweep", name, "backend", m, res["backend"], 2.0 * m * n * k, wbytes,
                            CEIL["fp8_tflops"], n=n, k=k, reps=reps))
            best = min((v, lbl) for lbl, v in res.items())
            alt = next(lbl for lbl in res if lbl.startswith("auto/"))
            print(f"BEST {name:16s} M={m:<3d} {best[1]:22s} {best[0] * 1e3:7.2f} us; auto "
                  f"{res['auto'] * 1e3:7.2f} us (x{res['auto'] / best[0]:.2f}), {alt} "
                  f"{res[alt] * 1e3:7.2f}, backend {res['backend'] * 1e3:7.2f}, floor "
                  f"{wbytes / 4.2e12 * 1e6:6.2f} us", flush=True)
        copies = None
        torch.cuda.empty_cache()


PDL_SHAPES = [("flash.o_proj", 2048, 8192), ("flash.q_b_proj", 8192, 768), ("flash.qkv_a", 1344, 2048),
              ("flash.idx.wk", 128, 2048)]


def bench_small_m_pdl(rows, rounds=3):
    """The fused kernel as a programmatic dependent launch or not: R back-to-back calls in one graph, the
    two variants interleaved `rounds` times in this process (median per call of each round)."""
    from glm_ray.kernels.cuda import fp8_small_m
    from tests.kernels.cases import dense_fp8_case
    for name, n, k in PDL_SHAPES:
        _, w, s = dense_fp8_case(1, n, k, device=DEV)
        wbytes = n * k + 4 * s.numel()
        reps = chain_reps(wbytes)
        copies = [(w.clone(), s.clone()) for _ in range(reps)]
        for m in (1, 16, 64):
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            got = {False: [], True: []}
            for _ in range(rounds):
                for pdl in (False, True):
                    fns = [lambda a=a, b=b, pdl=pdl: fp8_small_m.block_fp8_linear_small_m(x, a, b, pdl=pdl)
                           for a, b in copies]
                    got[pdl].append(graph_per_call_ms(fns))
            for pdl in (False, True):
                med = sorted(got[pdl])[rounds // 2]
                rows.append(row("pdl", name, "pdl" if pdl else "plain", m, med, 2.0 * m * n * k, wbytes,
                                CEIL["fp8_tflops"], n=n, k=k, reps=reps, rounds_us=[round(v * 1e3, 2) for v in got[pdl]]))
            # the output of the last call equals the plain launch's (same kernel, same bits)
            a, b = copies[-1]
            same = torch.equal(fp8_small_m.block_fp8_linear_small_m(x, a, b, pdl=True),
                               fp8_small_m.block_fp8_linear_small_m(x, a, b))
            print(f"PDL {name:16s} M={m:<3d} plain {sorted(got[False])[rounds // 2] * 1e3:6.2f} us  pdl "
                  f"{sorted(got[True])[rounds // 2] * 1e3:6.2f} us per call (R={reps}); equal: {same}", flush=True)
        copies = None
        torch.cuda.empty_cache()


def bench_decode_small_ops(rows, ts=(1, 8, 32, 64, 256)):
    """The per-layer small ops of a decode step against the torch ops they replace, each a CUDA-graph
    replay (as decode runs): `fp32_linear` (one Triton launch) vs x.float() + cuBLAS fp32 GEMM, and
    `swiglu` (one launch) vs silu + product, at glm5-flash-31b (E 64, D 2048, I 1536) and GLM-5 (E 256,
    D 6144, I 2048) shapes. Bytes: what the op must read and write."""
    import torch.nn.functional as F

    from glm_ray.kernels.cuda.fp32_linear import fp32_linear
    from glm_ray.kernels.cuda.swiglu import swiglu
    from glm_ray.kernels.torch_ref.moe import swiglu as ref_swiglu
    for geo, e, d, inter in (("flash", 64, 2048, 1536), ("glm5", 256, 6144, 2048)):
        w = torch.randn(e, d, device=DEV) * d ** -0.5
        for t in ts:
            x = torch.randn(t, d, device=DEV, dtype=torch.bfloat16)
            nbytes = e * d * 4 + t * d * 2 + t * e * 4
            for v, fn in (("triton", lambda: fp32_linear(x, w)), ("torch", lambda: F.linear(x.float(), w))):
                rows.append(row("small", f"{geo}.router", v, t, bench_graph_ms(fn), 2.0 * t * e * d, nbytes,
                                CEIL["bf16_tflops"]))
            gu = torch.randn(t, 2 * inter, device=DEV, dtype=torch.bfloat16)
            nbytes = t * inter * 2 * 3
            for v, fn in (("triton", lambda: swiglu(gu[:, :inter], gu[:, inter:])),
                          ("torch", lambda: ref_swiglu(gu[:, :inter], gu[:, inter:]))):
                rows.append(row("small", f"{geo}.swiglu", v, t, bench_graph_ms(fn), 4.0 * t * inter, nbytes,
                                CEIL["bf16_tflops"]))


def bench_prefill_fp32_linear(rows, ts=(512, 2048, 8192)):
    """`fp32_linear` at prefill sizes: the split-weight kernel (three bf16 parts on the tensor cores; FLOPs counted
    once, the fp32 GEMM's, so the rate compares with it) vs the torch reference (cast + cuBLAS fp32), CUDA-graph
    replays. Bytes: x, the weight (three bf16 parts / fp32), y."""
    import torch.nn.functional as F

    from glm_ray.kernels.cuda.fp32_split import fp32_linear_split, split3
    for name, e, d in (("flash.router", 64, 2048), ("flash.index_w", 32, 2048), ("glm5.router", 256, 6144),
                       ("glm5.index_w", 64, 6144)):
        w = torch.randn(e, d, device=DEV) * d ** -0.5
        w3 = split3(w)
        for t in ts:
            x = torch.randn(t, d, device=DEV, dtype=torch.bfloat16)
            for v, fn, wbytes in (("split", lambda: fp32_linear_split(x, w3), 6), ("torch", lambda: F.linear(x.float(), w), 4)):
                rows.append(row("prefill", name, v, t, bench_graph_ms(fn), 2.0 * t * e * d,
                                t * d * 2 + e * d * wbytes + t * e * 4, CEIL["bf16_tflops"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--quick", action="store_true", help="fewer points (M 256/2048/16384, MoE T 1/2048)")
    ap.add_argument("--no-moe", action="store_true")
    ap.add_argument("--small-m", action="store_true",
                    help="only the decode-size block-FP8 table (M 1..64; --quick: M 1/8/64) instead of the above")
    ap.add_argument("--small-m-sweep", action="store_true",
                    help="only the fused small-M kernel's tile sweep at the glm5-flash-31b decode shapes")
    ap.add_argument("--budget-s", type=float, default=420.0, help="--small-m-sweep stops after this long")
    ap.add_argument("--small-m-pdl", action="store_true",
                    help="only the fused small-M kernel with and without programmatic dependent launch")
    ap.add_argument("--decode-small-ops", action="store_true",
                    help="only the decode step's small ops (router GEMM, SwiGLU) vs the torch ops they replace")
    ap.add_argument("--prefill-fp32-linear", action="store_true",
                    help="only fp32_linear at prefill sizes: the split-weight tensor-core kernel vs cuBLAS fp32")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device", file=sys.stderr)
        return 2
    from glm_ray.kernels.cuda import CudaKernels
    ck = CudaKernels("scaled_mm")
    ck.small_m = 0          # "backend" = act quant + _scaled_mm at every M; the fused kernel is timed on its own
    torch.backends.cuda.matmul.allow_tf32 = False
    ms = [256, 2048, 16384] if a.quick else MS
    ts = [1, 2048] if a.quick else MOE_TS
    info = {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
            "torch": torch.__version__, "python": platform.python_version(), "ceilings": CEIL}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    print(json.dumps(info), flush=True)
    rows: list[dict] = []
    t0 = time.time()
    if a.decode_small_ops:
        bench_decode_small_ops(rows)
    elif a.prefill_fp32_linear:
        bench_prefill_fp32_linear(rows)
    elif a.small_m_pdl:
        bench_small_m_pdl(rows)
    elif a.small_m_sweep:
        if ck.tk is None:
            print(f"bench_kernels --small-m-sweep: {ck.triton_error}", file=sys.stderr)
            return 2
        bench_small_m_sweep(ck, rows, t0 + a.budget_s)
    elif a.small_m:
        if ck.tk is None:
            print(f"bench_kernels --small-m: {ck.triton_error}", file=sys.stderr)
            return 2
        bench_small_m(ck, [1, 8, 64] if a.quick else SMALL_MS, rows)
    else:
        bench_dense(ck, ms, rows, triton_ms={256, 4096} if ck.tk is not None else set())
        if not a.no_moe and ck.tk is not None:
            bench_moe(ck, ts, rows, ["bf16", "fp8", "mxfp4"])
    info["fallbacks"] = {f"{k[0]}: {k[1]}": v for k, v in ck.fallbacks.items()}
    info["selfcheck"] = {str(k): v for k, v in ck._selfcheck.items()}
    info["wall_s"] = round(time.time() - t0, 1)
    with open(a.out, "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=1)
    print(f"wrote {len(rows)} rows to {a.out} in {info['wall_s']} s; fallbacks: {info['fallbacks'] or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
