"""Micro-benchmark of the Triton DSA lightning-indexer decode kernel (glm_ray/kernels/cuda/indexer.py):
per batch size B and context length, the median GPU time of the scores kernel alone and of scores +
top-k, the bytes the scores kernel moves and the bandwidth it reaches (vs the H200's ~4.2 TB/s
achievable HBM read rate).

    python -m glm_ray.bench.indexer [--batch 1 8 32 64] [--context 1024 8192 32768] [--json out.jsonl]
    python -m glm_ray.bench.indexer --topk-only --batch 1 8 64 --context 8192 32768

    python -m glm_ray.bench.indexer --prefill 1x1024 8x1024 1x8192 4x8192

--prefill B x L times the prefill path (`indexer_prefill_topk`: a row per query token of B fresh
L-token prompts, causal) against the torch reference `indexer_topk`, eagerly (CUDA events, median of
--iters, L2 warm): useful TFLOPS = B * L(L+1)/2 * Hi * di * 2 / time, beside the 989 TFLOPS BF16 peak
(an fp32 query, `--qi-dtype float32`, runs as 3 bf16 dots, so the tensor cores do 3x that work). Beside it,
interleaved in 3 rounds (best of each): the index list + the sparse MLA prefill's bitmap kernel
(`idx_bits_us`, the path before `SelectionBits`) vs the bitmap written by the top-k (`bits_us`), and their
ratio (`bits_gain`); the two bitmaps are checked equal first.

--topk-only times the top-k alone (`select_topk` on random fp32 scores [B, context], every row full):
the Triton radix select (kernels/cuda/topk.py) against torch.topk, same timing method.

GLM-5 shapes: 32 indexer heads x 128, bf16 keys, bf16 queries (the engine's: wq_b's output dtype;
`--qi-dtype float32` for fp32 models), fp32 head weights, top-2048. Every sequence
of a row has the same context, its blocks scattered over the cache (random block table). Each op is
captured once in a CUDA graph (as decode runs) and timed on graph replays with CUDA events, with the
L2 cache flushed before every replay (--no-flush keeps it warm: small contexts then fit in L2).
Bytes (scores kernel): keys B * ctx * di * 2 + block table B * nb * 4 + qi B * Hi * di * 4 + w B * Hi * 4
+ the scores written B * kmax * 4. Needs CUDA; imports (and --help) work without a GPU.
"""
from __future__ import annotations

import argparse
from functools import partial

import torch

from glm_ray.bench.gpu_timing import PEAK_BF16_TFLOPS, eager_us, graph_replay_us
from glm_ray.bench.table import append_rows, print_rows
from glm_ray.forward_batch import build_forward_batch
from glm_ray.kernels.torch_ref.indexer import SCORE_BYTES
from glm_ray.kernels.torch_ref.indexer import indexer_topk as ref_topk

HBM_TBPS = 4.2
COLS = ["B", "context", "scores_us", "topk_us", "total_us", "MB", "TB/s", "frac_4.2"]
TOPK_COLS = ["B", "context", "k", "programs", "triton_us", "torch_us", "speedup"]


def _kernels():
    """The kernel module (imports triton): loaded on first use, so --help needs neither triton nor a GPU."""
    from glm_ray.kernels.cuda import indexer  # noqa: PLC0415 - lazy: triton only when benchmarking
    return indexer


@torch.inference_mode()
def run(batches: list[int], contexts: list[int], *, heads: int = 32, head_dim: int = 128, block_size: int = 64,
        topk: int = 2048, iters: int = 50, flush: bool = True, qi_dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    K = _kernels()
    T = K.radix_topk
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    buf = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev) if flush else None
    rows = []
    for ctx in contexts:
        for B in batches:
            nb = -(-ctx // block_size)
            kmax = nb * block_size
            key_cache = torch.randn(B * nb * block_size, head_dim, generator=g, device=dev).to(torch.bfloat16)
            bt = torch.randperm(B * nb, generator=g, device=dev).view(B, nb).to(torch.int32)   # [B, nb]
            cl = torch.full((B,), ctx, dtype=torch.int32, device=dev)
            qi = torch.randn(B, heads, head_dim, generator=g, device=dev).to(qi_dtype)
            w = torch.randn(B, heads, generator=g, device=dev) * heads ** -0.5

            args = (qi, w, key_cache, bt, cl, block_size)
            t_s = graph_replay_us(partial(K.indexer_decode_scores, *args, kmax), iters, buf)
            t_all = graph_replay_us(partial(K.indexer_decode_topk, *args, topk, kmax), iters, buf)
            nbytes = (B * ctx * head_dim * key_cache.element_size() + B * nb * 4
                      + B * heads * head_dim * qi.element_size() + B * heads * 4 + B * kmax * 4)
            tbps = nbytes / (t_s * 1e-6) / 1e12
            rows.append({"bench": "indexer_decode", "B": B, "context": ctx, "heads": heads, "head_dim": head_dim,
                         "block_size": block_size, "topk": topk, "block_n": K.BLOCK_N, "tiles": K._tiles(B, kmax),
                         "num_warps": K.NUM_WARPS, "qi_parts": K.FP32_QUERY_PARTS,
                         "topk_impl": K.TOPK_IMPL, "topk_chunk": K.TOPK_CHUNK or T.CHUNK,
                         "topk_warps": K.TOPK_WARPS or T.NUM_WARPS, "topk_programs": T.TARGET_PROGRAMS,
                         "qi_dtype": str(qi_dtype).removeprefix("torch."), "flush_l2": flush,
                         "scores_us": t_s, "topk_us": t_all - t_s, "total_us": t_all,
                         "MB": nbytes / 1e6, "TB/s": tbps, "frac_4.2": tbps / HBM_TBPS})
            del args, key_cache                                  # free before the next (bigger) cache
    return rows


@torch.inference_mode()
def run_topk(batches: list[int], contexts: list[int], *, topk: int = 2048, iters: int = 50,
             flush: bool = True) -> list[dict]:
    """`select_topk` alone on random fp32 scores [B, context] (every row full): Triton vs torch.topk."""
    K = _kernels()
    T = K.radix_topk
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    buf = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev) if flush else None
    rows, impl0 = [], K.TOPK_IMPL
    for ctx in contexts:
        for B in batches:
            scores = torch.randn(B, ctx, generator=g, device=dev)                   # [B, ctx]
            cl = torch.full((B,), ctx, dtype=torch.int32, device=dev)
            k = min(topk, ctx)
            t = {}
            for impl in ("triton", "torch"):
                K.TOPK_IMPL = impl                                                  # read at capture
                t[impl] = graph_replay_us(partial(K.select_topk, scores, cl, k), iters, buf)
            K.TOPK_IMPL = impl0
            chunk = K.TOPK_CHUNK or T.CHUNK
            rows.append({"bench": "indexer_topk", "B": B, "context": ctx, "k": k,
                         "programs": T.programs_per_row(B, ctx, chunk), "topk_chunk": chunk,
                         "topk_warps": K.TOPK_WARPS or T.NUM_WARPS, "topk_programs": T.TARGET_PROGRAMS,
                         "flush_l2": flush, "triton_us": t["triton"], "torch_us": t["torch"],
                         "speedup": t["torch"] / t["triton"]})
    return rows


PREFILL_COLS = ["B", "L", "rows", "us", "TFLOPS", "peak_ratio", "ref_us", "speedup", "idx_bits_us", "bits_us",
                "bits_TFLOPS", "bits_gain"]


@torch.inference_mode()
def run_prefill(shapes: list[tuple[int, int]], *, heads: int = 32, head_dim: int = 128, block_size: int = 64,
                topk: int = 2048, iters: int = 10, qi_dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """`indexer_prefill_topk` vs the torch reference on B fresh L-token prompts (one prefill group)."""
    K = _kernels()
    from glm_ray.kernels.cuda import mla_prefill as mp  # noqa: PLC0415 - lazy: triton only when benchmarking
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for B, L in shapes:
        nb = -(-L // block_size)
        key_cache = torch.randn(B * nb * block_size, head_dim, generator=g, device=dev).to(torch.bfloat16)
        perm = torch.randperm(B * nb, generator=torch.Generator().manual_seed(B * L)).tolist()   # host ids
        tables = [perm[i * nb:(i + 1) * nb] for i in range(B)]
        qi = torch.randn(B * L, heads, head_dim, generator=g, device=dev).to(qi_dtype)
        w = torch.randn(B * L, heads, generator=g, device=dev) * heads ** -0.5
        (group,) = build_forward_batch([L] * B, [L] * B, tables, block_size, dev).groups
        index = partial(K.indexer_prefill_topk, qi, w, key_cache, group, topk, max_bytes=SCORE_BYTES)
        # what the sparse MLA prefill read before the bitmap form: the index list, then its bitmap kernel
        plan = mp.prefill_plan(group.block_table, group.context_lens, group.query_lens, group.token_index,
                               group.block_size, group.max_context_len, block_m=128, block_n=64,
                               chunk=group.max_context_len)
        bits_ok = L <= K.radix_topk.BITS_MAX_KEYS and K.TOPK_IMPL == "triton"
        if bits_ok:
            assert torch.equal(index(bits=True).bits, mp.selection_bits(index(), plan)), "bitmap != the index picks"
        ts = {"us": [], "idx_bits_us": [], "bits_us": []}
        for _ in range(3):                                                   # the forms interleaved, 3 rounds
            ts["us"].append(eager_us(index, iters))
            if bits_ok:
                ts["idx_bits_us"].append(eager_us(lambda: mp.selection_bits(index(), plan), iters))
                ts["bits_us"].append(eager_us(partial(index, bits=True), iters))
        t, t_ib, t_b = (min(v) if v else float("nan") for v in ts.values())
        t_ref = eager_us(partial(ref_topk, qi, w, key_cache, group, topk), max(2, iters // 3))
        flop = B * L * (L + 1) / 2 * heads * head_dim * 2
        tflops = flop / (t * 1e-6) / 1e12
        rows.append({"bench": "indexer_prefill", "B": B, "L": L, "rows": B * L, "heads": heads, "head_dim": head_dim,
                     "topk": topk, "topk_impl": K.TOPK_IMPL, "qi_dtype": str(qi_dtype).removeprefix("torch."),
                     "us": t, "TFLOPS": tflops,
                     "peak_ratio": tflops / PEAK_BF16_TFLOPS, "ref_us": t_ref, "speedup": t_ref / t,
                     "bits_chunk": K.radix_topk.BITS_CHUNK, "bits_warps": K.radix_topk.BITS_WARPS,
                     "idx_bits_us": t_ib, "bits_us": t_b, "bits_TFLOPS": flop / (t_b * 1e-6) / 1e12,
                     "bits_gain": t_ib / t_b})
        del key_cache, qi, w, group
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--context", type=int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--qi-dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--no-flush", action="store_true", help="keep L2 warm between replays")
    p.add_argument("--block-n", type=int, default=None, help="override the kernel's positions per program")
    p.add_argument("--tiles", type=int, default=None, help="override the kernel's tiles per program")
    p.add_argument("--num-warps", type=int, default=None, help="override the kernel's warps per program")
    p.add_argument("--topk-impl", choices=["triton", "torch"], default=None, help="override the top-k path")
    p.add_argument("--topk-chunk", type=int, default=None, help="override the top-k kernel's scores per step")
    p.add_argument("--topk-warps", type=int, default=None, help="override the top-k kernel's warps")
    p.add_argument("--topk-programs", type=int, default=None,
                   help="override the top-k's target programs per launch (topk.TARGET_PROGRAMS)")
    p.add_argument("--bits-chunk", type=int, default=None, help="override topk_bits' scores per loop step")
    p.add_argument("--bits-warps", type=int, default=None, help="override topk_bits' warps per program")
    p.add_argument("--topk-only", action="store_true", help="time the top-k alone: Triton vs torch.topk")
    p.add_argument("--parts", type=int, default=None, help="override the bf16 parts of an fp32 query (1-3)")
    p.add_argument("--prefill", nargs="+", default=None, metavar="BxL",
                   help="time the prefill path on B fresh L-token prompts (e.g. 8x1024) vs the torch reference")
    p.add_argument("--json", default=None, help="also append the rows to this JSONL file")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("glm_ray.bench.indexer needs a CUDA GPU")
    K = _kernels()
    if a.block_n:
        K.BLOCK_N = a.block_n
    if a.tiles:
        K.TILES = a.tiles
    if a.num_warps:
        K.NUM_WARPS = a.num_warps
    if a.topk_impl:
        K.TOPK_IMPL = a.topk_impl
    if a.topk_chunk:
        K.TOPK_CHUNK = a.topk_chunk
    if a.topk_warps:
        K.TOPK_WARPS = a.topk_warps
    if a.parts:
        K.FP32_QUERY_PARTS = a.parts
    if a.bits_chunk:
        K.radix_topk.BITS_CHUNK = a.bits_chunk
    if a.bits_warps:
        K.radix_topk.BITS_WARPS = a.bits_warps
    if a.topk_programs:
        K.radix_topk.TARGET_PROGRAMS = a.topk_programs
    if a.prefill:
        shapes = [tuple(int(x) for x in s.lower().split("x")) for s in a.prefill]
        rows = run_prefill(shapes, block_size=a.block_size, topk=a.topk, iters=min(a.iters, 10),
                           qi_dtype=getattr(torch, a.qi_dtype))
        print_rows(rows, PREFILL_COLS, width=10)
        append_rows(a.json, rows)
        return 0
    if a.topk_only:
        rows = run_topk(a.batch, a.context, topk=a.topk, iters=a.iters, flush=not a.no_flush)
        print_rows(rows, TOPK_COLS, width=10)
        append_rows(a.json, rows)
        return 0
    rows = run(a.batch, a.context, block_size=a.block_size, topk=a.topk, iters=a.iters, flush=not a.no_flush,
               qi_dtype=getattr(torch, a.qi_dtype))
    print_rows(rows, COLS, width=10)
    append_rows(a.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
