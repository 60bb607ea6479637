"""Micro-benchmark of the decode-size fused MoE (glm_ray/kernels/cuda/moe_decode.py: two launches, no
sorting) against the grouped path (`fused_moe_triton`: moe_align + two grouped kernels + combine), per
expert shape, weight format and token count T:

    python -m glm_ray.bench.moe_decode [--geo flash glm5] [--mode bf16 fp8] [--tokens 1 2 4 8 16 32 64]
                                       [--json out.jsonl]

Shapes: glm5-flash-31b experts (E=64, D=2048, I=1536, top-4) and GLM-5 (E=256, D=6144, I=2048, top-8),
all E experts allocated (random weights; fp8 with constant block scales), uniform random top-k routing.
Each variant is captured once in a CUDA graph (as decode runs) and timed on graph replays with CUDA
events, the L2 cache flushed before every replay (--no-flush keeps it warm: small T then fits in L2).
Bytes = distinct routed experts x expert bytes (w13 + w2 + fp8 block scales): what a kernel must read at
least; the decode kernels read an expert once per (token, slot) pair that chose it (`MB_pairs`), minus
what the L2 catches. TB/s = bytes / time, `frac` = TB/s / 4.2 (the H200's achievable HBM read rate).
The tile overrides (--bn1 ... --stages2) replace fields of the shape heuristic's `DecodeConfig`.
Needs CUDA; imports (and --help) work without a GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
from functools import partial

import torch

from glm_ray.bench.gpu_timing import graph_replay_us
from glm_ray.bench.table import append_rows, print_rows

HBM_TBPS = 4.2
GEOS = {"flash": dict(e=64, d=2048, i=1536, k=4), "glm5": dict(e=256, d=6144, i=2048, k=8)}
COLS = ["geo", "w_mode", "T", "distinct", "decode_us", "grouped_us", "speedup", "MB", "dec_TB/s", "dec_frac",
        "grp_TB/s", "grp_frac"]
TILE_FIELDS = ("bn1", "bk1", "warps1", "stages1", "bn2", "bk2", "warps2", "stages2")   # DecodeConfig


def moe_modules():
    """(moe_decode, triton_kernels) — imports triton on first use, so --help needs neither triton nor a GPU."""
    from glm_ray.kernels.cuda import moe_decode, triton_kernels  # noqa: PLC0415 - lazy: triton only to benchmark
    return moe_decode, triton_kernels


def random_experts(geo: dict, w_mode: str, dev: torch.device, gen: torch.Generator):
    """(w13 [E, 2I, D], s13, w2 [E, D, I], s2): random values (timing only). fp8: N(0, 32^2) cast to e4m3
    (|w| < 448 up to ~14 sigma: no NaN), every block scale 1/256."""
    e, d, i = geo["e"], geo["d"], geo["i"]
    if w_mode == "bf16":
        w13 = torch.randn(e, 2 * i, d, generator=gen, device=dev, dtype=torch.bfloat16) * d ** -0.5
        w2 = torch.randn(e, d, i, generator=gen, device=dev, dtype=torch.bfloat16) * i ** -0.5
        return w13, None, w2, None
    w13 = torch.empty(e, 2 * i, d, dtype=torch.float8_e4m3fn, device=dev)
    w2 = torch.empty(e, d, i, dtype=torch.float8_e4m3fn, device=dev)
    for a in range(e):                                           # one expert at a time: small temporaries
        w13[a] = torch.randn(2 * i, d, generator=gen, device=dev, dtype=torch.bfloat16) * 32
        w2[a] = torch.randn(d, i, generator=gen, device=dev, dtype=torch.bfloat16) * 32
    s13 = torch.full((e, 2 * (i // 128), d // 128), 1 / 256, device=dev)
    s2 = torch.full((e, d // 128, i // 128), 1 / 256, device=dev)
    return w13, s13, w2, s2


def _expert_bytes(geo: dict, w_mode: str) -> int:
    d, i = geo["d"], geo["i"]
    if w_mode == "bf16":
        return 3 * d * i * 2
    return 3 * d * i + (2 * (i // 128) * (d // 128) + (d // 128) * (i // 128)) * 4


@torch.inference_mode()
def run(geos: list[str], modes: list[str], tokens: list[int], *, iters: int = 50, flush: bool = True,
        overrides: dict | None = None) -> list[dict]:
    md, tk = moe_modules()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    buf = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev) if flush else None
    rows = []
    for gname in geos:
        geo = GEOS[gname]
        for w_mode in modes:
            w13, s13, w2, s2 = random_experts(geo, w_mode, dev, gen)
            for t in tokens:
                x = torch.randn(t, geo["d"], generator=gen, device=dev).to(torch.bfloat16)
                logits = torch.rand(t, geo["e"], generator=gen, device=dev)
                tw, ids = logits.topk(geo["k"], dim=-1)
                tw = (tw / tw.sum(-1, keepdim=True)).float()
                cfg = md.decode_config(w_mode, t, geo["k"], geo["d"], geo["i"], md.num_sms(dev))
                if overrides:
                    cfg = dataclasses.replace(cfg, **overrides)
                kw = dict(w_mode=w_mode, w13_scale=s13, w2_scale=s2)
                t_dec = graph_replay_us(partial(md.fused_moe_decode, x, w13, w2, tw, ids, config=cfg, **kw), iters, buf)
                t_grp = graph_replay_us(partial(tk.fused_moe_triton, x, w13, w2, tw, ids, **kw), iters, buf)
                distinct = int(torch.unique(ids).numel())       # host sync: benchmark bookkeeping only
                nbytes = distinct * _expert_bytes(geo, w_mode)
                dec_tbps = nbytes / (t_dec * 1e-6) / 1e12
                grp_tbps = nbytes / (t_grp * 1e-6) / 1e12
                rows.append({"bench": "moe_decode", "geo": gname, "w_mode": w_mode, "T": t, "K": geo["k"],
                             "E": geo["e"], "D": geo["d"], "I": geo["i"], "distinct": distinct,
                             "pairs": t * geo["k"], "decode_us": t_dec, "grouped_us": t_grp,
                             "speedup": t_grp / t_dec, "MB": nbytes / 1e6,
                             "MB_pairs": t * geo["k"] * _expert_bytes(geo, w_mode) / 1e6,
                             "dec_TB/s": dec_tbps, "dec_frac": dec_tbps / HBM_TBPS,
                             "grp_TB/s": grp_tbps, "grp_frac": grp_tbps / HBM_TBPS,
                             "flush_l2": flush, **dataclasses.asdict(cfg)})
            del w13, s13, w2, s2                                 # free before the next (bigger) set
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--geo", nargs="+", choices=sorted(GEOS), default=["flash", "glm5"])
    p.add_argument("--mode", nargs="+", choices=["bf16", "fp8"], default=["bf16", "fp8"])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--no-flush", action="store_true", help="keep L2 warm between replays")
    for name in TILE_FIELDS:
        p.add_argument(f"--{name}", type=int, default=None, help=f"override DecodeConfig.{name}")
    p.add_argument("--json", default=None, help="also append the rows to this JSONL file")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("glm_ray.bench.moe_decode needs a CUDA GPU")
    overrides = {n: getattr(a, n) for n in TILE_FIELDS if getattr(a, n) is not None}
    rows = run(a.geo, a.mode, a.tokens, iters=a.iters, flush=not a.no_flush, overrides=overrides)
    print_rows(rows, COLS, width=10)
    append_rows(a.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
