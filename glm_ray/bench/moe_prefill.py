"""Tile sweep of the grouped fused MoE (`fused_moe_triton`: moe_align + the up and down grouped kernels +
combine) at prefill token counts, against the GEMM rate the H200 measured (issue #20 item 3):

    python -m glm_ray.bench.moe_prefill [--geo flash glm5] [--mode fp8 bf16] [--tokens 512 2048 8192]
        [--configs default 64:128:128:128:8:8:3 32:128:64:128:8:4:4 ...] [--json out.jsonl]

Shapes as `bench.moe_decode` (glm5-flash-31b experts: E=64, D=2048, I=1536, top-4; GLM-5: E=256, D=6144,
I=2048, top-8; random weights, uniform random top-k). A config is BM:BN1:BN2:BK:WARPS1:WARPS2:STAGES (stage 1
= the gate/up kernel, stage 2 = the down kernel; one BM and BK and stages for both), or `default` for the
shape heuristic (`layout.moe_configs`). FP8 needs BK = 128 and BN1 = 128 (one scale group per K step, the
re-quantization group of the stage-2 input is a stage-1 tile row); MXFP4 / bf16 need multiples of 32. Each
(config, T) is captured in a CUDA graph (prefill steps replay piecewise graphs) and timed on replays with
the L2 flushed. FLOPs = 6 * T * top_k * D * I (gate + up + down, multiply-add = 2); `tflops` and `of_peak`
against MEASURED_FP8_TFLOPS / MEASURED_BF16_TFLOPS (bench/gpu_timing.py). A config the kernels reject
(shared memory, a constraint) is reported with its error instead of a time. Needs CUDA; --help does not.
"""
from __future__ import annotations

import argparse
import contextlib
from functools import partial

import torch

from glm_ray.bench.gpu_timing import MEASURED_BF16_TFLOPS, MEASURED_FP8_TFLOPS, graph_replay_us
from glm_ray.bench.moe_decode import GEOS, moe_modules, random_experts
from glm_ray.bench.table import append_rows, print_rows
from glm_ray.kernels.cuda.layout import TileConfig

COLS = ["geo", "w_mode", "T", "rows_per_expert", "config", "us", "tflops", "of_peak", "error"]


def parse_config(text: str):
    """'default' -> None; 'BM:BN1:BN2:BK:W1:W2:S' -> (stage-1 TileConfig, stage-2 TileConfig)."""
    if text == "default":
        return None
    parts = text.split(":")
    if len(parts) != 7 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected BM:BN1:BN2:BK:WARPS1:WARPS2:STAGES or 'default'")
    bm, bn1, bn2, bk, w1, w2, st = map(int, parts)
    return TileConfig(bm, bn1, bk, w1, st), TileConfig(bm, bn2, bk, w2, st)


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


@torch.inference_mode()
def run(geos: list[str], modes: list[str], tokens: list[int], configs: list[str], *, iters: int = 20) -> list[dict]:
    _, tk = moe_modules()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    buf = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    rows = []
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
                for text in configs:
                    row = {"bench": "moe_prefill", "geo": gname, "w_mode": w_mode, "T": t, "K": geo["k"],
                           "E": geo["e"], "D": geo["d"], "I": geo["i"], "config": text,
                           "rows_per_expert": t * geo["k"] / geo["e"], "us": float("nan"), "tflops": float("nan"),
                           "of_peak": float("nan"), "error": ""}
                    fn = partial(tk.fused_moe_triton, x, w13, w2, tw, ids, w_mode=w_mode, w13_scale=s13, w2_scale=s2)
                    try:
                        with tiles(tk, parse_config(text)):
                            us = graph_replay_us(fn, iters, buf)
                    except Exception as e:  # noqa: BLE001 - a rejected config is a row, not the end of the sweep
                        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:120]
                        torch.cuda.synchronize()
                    else:
                        row.update(us=us, tflops=flops / (us * 1e-6) / 1e12)
                        row["of_peak"] = row["tflops"] / peak
                    rows.append(row)
                    print_rows([row], COLS, width=11)
            del w13, s13, w2, s2
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--geo", nargs="+", choices=sorted(GEOS), default=["flash"])
    p.add_argument("--mode", nargs="+", choices=["bf16", "fp8"], default=["fp8"])
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--configs", nargs="+", default=["default"], metavar="CFG",
                   help="BM:BN1:BN2:BK:WARPS1:WARPS2:STAGES or default (the shape heuristic)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None, help="also append the rows to this JSONL file")
    a = p.parse_args(argv)
    for c in a.configs:                                    # bad configs fail here, before any GPU work
        try:
            parse_config(c)
        except argparse.ArgumentTypeError as e:
            p.error(str(e))
    if not torch.cuda.is_available():
        raise SystemExit("glm_ray.bench.moe_prefill needs a CUDA GPU")
    rows = run(a.geo, a.mode, a.tokens, a.configs, iters=a.iters)
    print()
    print_rows(rows, COLS, width=11)
    append_rows(a.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
