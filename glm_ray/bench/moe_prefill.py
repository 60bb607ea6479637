"""The block-FP8 / bf16 routed experts at prefill token counts, old grouped kernels vs the prefill kernels, against
the GEMM rate the H200 measured (issue #20 item 3):

    python -m glm_ray.bench.moe_prefill [--geo flash glm5] [--mode fp8 bf16] [--tokens 512 2048 8192]
        [--path old new] [--configs default 64:128:128:128:8:8:3 ...] [--new-configs default 64:256:128:128:8:8:3:tma ...]
        [--stages] [--json out.jsonl]

Paths: `old` = `fused_moe_triton` (moe_align + act quant + the grouped up / down kernels that gather token rows +
the torch combine), `new` = `moe_prefill.fused_moe_prefill` (moe_align + the sorted pre-quantized activations +
gate and up in one [BM, 256] accumulator + down + the Triton combine; fp8 only). For each T every path and
config is timed in turn, so one run compares them on the same inputs; `speedup` = the first old config's time /
this row's time. Shapes as `bench.moe_decode` (glm5-flash-31b experts: E=64, D=2048, I=1536, top-4; GLM-5: E=256,
D=6144, I=2048, top-8; random weights, uniform random top-k).

A config is BM:BN1:BN2:BK:WARPS1:WARPS2:STAGES[:tma][:rN][:pN] (stage 1 = the gate/up kernel, stage 2 = the down
kernel; one BM and BK and stages for both), or `default` for the path's own table (`layout.moe_configs` /
`layout.moe_prefill_configs`). Old FP8: BK = 128, BN1 = 128; new: BN1 = 256 (128 gate + 128 up columns), BK =
128, BN2 in 64/128/256, `:tma` loads the operands through tensor descriptors, `:rN` caps the new kernels at N
registers a thread (two CTAs an SM: `64:256:128:128:8:8:2:tma:r128`), `:pN` makes them persistent with N programs
an SM (`TileConfig.persistent`); MXFP4 / bf16 need multiples of 32.
Each (path, config, T) is captured in a CUDA graph (prefill steps replay piecewise graphs) and timed on replays
with the L2 flushed. FLOPs = 6 * T * top_k * D * I (gate + up + down, multiply-add = 2); `tflops` and `of_peak`
against MEASURED_FP8_TFLOPS / MEASURED_BF16_TFLOPS (bench/gpu_timing.py). `--stages` also times each launch of
the fp8 paths alone (act quant, up, down, combine; the same intermediates), with `up_peak` / `down_peak` =
the kernel's own FLOPs (4 / 2 * T * top_k * D * I) per second over the FP8 rate. A config a path rejects
(shared memory, a constraint) is reported with its error instead of a time. Needs CUDA; --help does not.
"""
from __future__ import annotations

import argparse
import contextlib
from functools import partial

import torch

from glm_ray.bench.gpu_timing import MEASURED_BF16_TFLOPS, MEASURED_FP8_TFLOPS, graph_replay_us
from glm_ray.bench.moe_decode import GEOS, random_experts
from glm_ray.bench.table import append_rows, print_rows
from glm_ray.kernels.cuda.layout import TileConfig, cdiv, moe_configs, moe_prefill_configs

COLS = ["geo", "w_mode", "T", "rows_per_expert", "path", "config", "us", "tflops", "of_peak", "speedup", "error"]
STAGE_COLS = ["quant_us", "up_us", "up_peak", "down_us", "down_peak", "comb_us"]
PATHS = ("old", "new")


def parse_config(text: str):
    """'default' -> None; 'BM:BN1:BN2:BK:W1:W2:S[:tma][:rN][:pN]' -> (stage-1 TileConfig, stage-2 TileConfig); `rN`
    caps both kernels at N registers a thread (`TileConfig.maxnreg`), `pN` makes both persistent with N programs an
    SM (`TileConfig.persistent`)."""
    if text == "default":
        return None
    parts, opts = text.split(":")[:7], text.split(":")[7:]
    tma = "tma" in opts
    regs = [int(o[1:]) for o in opts if o[:1] == "r" and o[1:].isdigit()]
    pers = [int(o[1:]) for o in opts if o[:1] == "p" and o[1:].isdigit() and int(o[1:]) > 0]
    if (len(parts) != 7 or not all(p.isdigit() for p in parts) or len(opts) != tma + len(regs) + len(pers)
            or len(regs) > 1 or len(pers) > 1 or len(set(opts)) != len(opts)):
        raise argparse.ArgumentTypeError(f"{text!r}: expected BM:BN1:BN2:BK:WARPS1:WARPS2:STAGES[:tma][:rN][:pN] "
                                         "or 'default'")
    bm, bn1, bn2, bk, w1, w2, st = map(int, parts)
    maxnreg = regs[0] if regs else None
    persistent = pers[0] if pers else 0
    return (TileConfig(bm, bn1, bk, w1, st, tma=tma, maxnreg=maxnreg, persistent=persistent),
            TileConfig(bm, bn2, bk, w2, st, tma=tma, maxnreg=maxnreg, persistent=persistent))


def moe_modules():
    """(triton_kernels, moe_prefill) — imports triton on first use, so --help needs neither triton nor a GPU."""
    from glm_ray.kernels.cuda import moe_prefill, triton_kernels  # noqa: PLC0415 - lazy: triton only to benchmark
    return triton_kernels, moe_prefill


@contextlib.contextmanager
def tiles(tk, cfgs):
    """Within the block, `fused_moe_triton` uses `cfgs` instead of the shape heuristic (None: unchanged)."""
    if cfgs is None:
        yield
        return
    orig = tk.moe_configs
    tk.moe_configs = lambda w_mode, num_pairs, num_experts: cfgs
    try:
        yield
    finally:
        tk.moe_configs = orig


def call(path: str, tk, mp, x, w13, s13, w2, s2, tw, ids, w_mode: str, cfgs):
    """A no-argument function running one MoE call of `path` with `cfgs` (None: the path's table)."""
    if path == "new":
        if w_mode != "fp8":
            raise ValueError("the prefill kernels are block-FP8 only")
        return partial(mp.fused_moe_prefill, x, w13, w2, tw, ids, w13_scale=s13, w2_scale=s2, configs=cfgs)

    def old():
        with tiles(tk, cfgs):
            return tk.fused_moe_triton(x, w13, w2, tw, ids, w_mode=w_mode, w13_scale=s13, w2_scale=s2)
    return old


def stage_fns(path: str, tk, mp, x, w13, s13, w2, s2, tw, ids, cfgs) -> dict:
    """{stage: no-argument function} for each launch of one fp8 call of `path` (alignment excluded), on
    intermediates built here once, so each stage can be timed alone."""
    t, d = x.shape
    e, k, i = w13.shape[0], ids.shape[1], w13.shape[1] // 2
    p, dev, fp8 = t * k, x.device, torch.float8_e4m3fn
    c1, c2 = cfgs or (moe_prefill_configs(p, e) if path == "new" else moe_configs("fp8", p, e))
    al = mp.moe_align_auto(ids, e, c1.block_m)
    twf = tw.reshape(-1).float().contiguous()
    out_pairs = torch.empty(p, d, dtype=x.dtype, device=dev)
    if path == "new":
        mp.check_configs(c1, c2)
        em = al.max_blocks * al.block_m
        aq, a_s = mp.sorted_act_quant(x, al.sorted_ids, al.num_post_pad, k, em)
        inter = torch.empty(em, i, dtype=fp8, device=dev)
        inter_s = torch.empty(cdiv(i, 128), em, device=dev)
        return {"quant": lambda: mp.sorted_act_quant(x, al.sorted_ids, al.num_post_pad, k, em),
                "up": lambda: mp._up(aq, a_s, w13, s13, inter, inter_s, al, d, i, c1, ue8m0=False, limit=None),
                "down": lambda: mp._down(inter, inter_s, w2, s2, out_pairs, twf, al, p, d, i, c2),
                "comb": lambda: mp.combine_pairs(out_pairs, t, k, x.dtype)}
    a, a_s = tk.act_quant_fp8(x)
    inter = torch.empty(p, i, dtype=fp8, device=dev)
    inter_s = torch.empty(p, cdiv(i, 128), device=dev)
    return {"quant": lambda: tk.act_quant_fp8(x),
            "up": lambda: tk._up(a, a_s, w13, s13, inter, inter_s, al, p, k, d, i, i, s13.shape[1] // 2, c1,
                                 w_mode=tk.W_FP8, out_mode=tk.OUT_FP8),
            "down": lambda: tk._down(inter, inter_s, w2, s2, out_pairs, twf, al, p, d, i, c2, w_mode=tk.W_FP8),
            "comb": lambda: tk._combine(out_pairs, t, k, d, x.dtype)}


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:120]


@torch.inference_mode()
def run(geos: list[str], modes: list[str], tokens: list[int], configs: list[str], *, paths=PATHS,
        new_configs: list[str] = ("default",), iters: int = 20, stages: bool = False) -> list[dict]:
    tk, mp = moe_modules()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    buf = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    rows = []
    cols = COLS + (STAGE_COLS if stages else [])
    for gname in geos:
        geo = GEOS[gname]
        for w_mode in modes:
            w13, s13, w2, s2 = random_experts(geo, w_mode, dev, gen)
            peak = MEASURED_FP8_TFLOPS if w_mode == "fp8" else MEASURED_BF16_TFLOPS
            for t in tokens:
                x = torch.randn(t, geo["d"], generator=gen, device=dev).to(torch.bfloat16)
                logits = torch.rand(t, geo["e"], generator=gen, device=dev)
                tw, ids = logits.topk(geo["k"], dim=-1)
                tw = (tw / tw.sum(-1, keepdim=True)).float()
                flops = 6.0 * t * geo["k"] * geo["d"] * geo["i"]
                base = None
                for path in paths:
                    if path == "new" and w_mode != "fp8":
                        continue
                    for text in (configs if path == "old" else new_configs):
                        row = {"bench": "moe_prefill", "geo": gname, "w_mode": w_mode, "T": t, "K": geo["k"],
                               "E": geo["e"], "D": geo["d"], "I": geo["i"], "path": path, "config": text,
                               "rows_per_expert": t * geo["k"] / geo["e"], "us": float("nan"),
                               "tflops": float("nan"), "of_peak": float("nan"), "speedup": float("nan"), "error": ""}
                        row.update({c: float("nan") for c in STAGE_COLS} if stages else {})
                        try:
                            cfgs = parse_config(text)
                            us = graph_replay_us(call(path, tk, mp, x, w13, s13, w2, s2, tw, ids, w_mode, cfgs),
                                                 iters, buf)
                            if stages and w_mode == "fp8":
                                fns = stage_fns(path, tk, mp, x, w13, s13, w2, s2, tw, ids, cfgs)
                                for name, fn in fns.items():
                                    row[f"{name}_us"] = graph_replay_us(fn, iters, buf)
                                for name, f in (("up", 4.0), ("down", 2.0)):
                                    row[f"{name}_peak"] = (f * t * geo["k"] * geo["d"] * geo["i"]
                                                           / (row[f"{name}_us"] * 1e-6) / 1e12 / peak)
                        except Exception as e:  # noqa: BLE001 - a rejected config is a row, not the end of the sweep
                            row["error"] = _error(e)
                            torch.cuda.synchronize()
                        else:
                            row.update(us=us, tflops=flops / (us * 1e-6) / 1e12)
                            row["of_peak"] = row["tflops"] / peak
                            if base is None and path == "old":
                                base = us
                            row["speedup"] = base / us if base else float("nan")
                        rows.append(row)
                        print_rows([row], cols, width=11)
            del w13, s13, w2, s2
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--geo", nargs="+", choices=sorted(GEOS), default=["flash"])
    p.add_argument("--mode", nargs="+", choices=["bf16", "fp8"], default=["fp8"])
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--path", nargs="+", choices=PATHS, default=list(PATHS),
                   help="old = fused_moe_triton, new = moe_prefill.fused_moe_prefill (fp8 only)")
    p.add_argument("--configs", nargs="+", default=["default"], metavar="CFG",
                   help="old path: BM:BN1:BN2:BK:WARPS1:WARPS2:STAGES or default (the shape heuristic)")
    p.add_argument("--new-configs", nargs="+", default=["default"], metavar="CFG",
                   help="new path: BM:256:BN2:128:WARPS1:WARPS2:STAGES[:tma] or default (moe_prefill_configs)")
    p.add_argument("--stages", action="store_true", help="also time each fp8 launch alone (quant, up, down, combine)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None, help="also append the rows to this JSONL file")
    a = p.parse_args(argv)
    for c in (*a.configs, *a.new_configs):                 # bad configs fail here, before any GPU work
        try:
            parse_config(c)
        except argparse.ArgumentTypeError as e:
            p.error(str(e))
    if not torch.cuda.is_available():
        raise SystemExit("glm_ray.bench.moe_prefill needs a CUDA GPU")
    rows = run(a.geo, a.mode, a.tokens, a.configs, paths=a.path, new_configs=a.new_configs, iters=a.iters,
               stages=a.stages)
    print()
    print_rows(rows, COLS + (STAGE_COLS if a.stages else []), width=11)
    append_rows(a.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
