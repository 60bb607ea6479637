"""Benchmarks of the attention kernels of the `cuda` backend at GLM-5 shapes, bf16, each against the
torch reference (`torch_ref.attention`) at the same shape.

    python -m glm_ray.bench.attention [--heads 16 32 64] [--batch 1 8 32 64] [--splits 0 1 2 4] [--json PATH]
    python -m glm_ray.bench.attention --mode prefill [--heads 8 32 64] [--prefill-shapes 1x1024 8x1024 1x8192 4x8192]

`--mode decode` (default, `--decode-configs BH:BN:WARPS:STAGES[:WS] ...` times kernel configs interleaved): bandwidth of the Triton paged MLA decode (`kernels/cuda/mla_decode.py`,
absorbed form; r = 512, dr = 64). Per (h, B, context) dense, and sparse (DSA, K = 2048 indices) at 8k /
32k: the median time of a CUDA-graph replay (decode runs under graphs; eager timing of a ~10 us kernel
measures the host's launch cost instead) with the L2 flushed before each (`triton.testing.do_bench`,
else CUDA events), the bytes the kernel must read (B * keys * D * 2 for the cache rows + q in + o_lat
out), the achieved TB/s and its ratio to the copy rate measured on the H200 (4.2 TB/s, bytes read +
written by a device-to-device copy), and the reference's time at the same shape (skipped where its
one-shot gather + scores would exceed 1 GiB; timed eagerly, host cost included). Decode MLA at h = 64
needs 121 FLOP per cache byte, so the tflops column is printed too.

`--mode prefill`: the Triton MLA prefill (`kernels/cuda/mla_prefill.py`, naive form) through
`mla_prefill_group` as the `mla_prefill` op runs it (gather + kv_b expansion + attention kernel, the
group's plan built once as for the layers of a step; max_bytes = the layer's 1 GiB) on B fresh prompts
of L tokens (`--prefix P`: after P cached tokens each), dense causal, and DSA-sparse (top-2048 of
random causal scores) where the context exceeds 2048. Timed eagerly (prefill runs outside CUDA graphs),
L2 flushed. Columns: `us` the whole op; `expand_us` the gather + kv_b GEMM alone (a bf16 F.linear),
`attn_us` = us - expand_us; `tflops` = (attention + expansion FLOPs) / us; `attn_tflops` = attention
FLOPs / attn_us, with attention FLOPs = 2 * h * (dqk + dv) per causal (query, key) pair — the work the
kernel's MMAs do in both modes (a sparse tile is skipped only when no query of it picked a key), so
sparse rows count the same FLOPs as dense; `peak_ratio` = attn_tflops / 989, the H200 SXM datasheet
dense BF16 peak (no sparsity). `--config BM BN WARPS STAGES` times
one kernel config instead of the table's (tuning); `--sparse-tiles skip noskip` times
the sparse rows once per way of walking the tiles (`mla_prefill.SparseTiles`; the default: the shipped one),
`--sparse-only` skips the dense rows of sparse shapes, `--key-loads pointer tma` times every row once per way of
loading the key tiles (pointer tiles, or TMA boxes: GLM_RAY_CUDA_MLA_PREFILL_TMA), interleaved in one process;
`--head-groups 1 4` once per launch order of the programs (`mla_prefill_varlen`'s head_group).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from glm_ray.bench.gpu_timing import PEAK_BF16_TFLOPS
from glm_ray.bench.table import append_rows, print_rows
from glm_ray.forward_batch import build_forward_batch
from glm_ray.kernels.cuda.mla_decode import default_num_splits, mla_decode_paged
from glm_ray.kernels.cuda.mla_prefill import SparseTiles, mla_prefill_group
from glm_ray.kernels.cuda.tma import mla_key_descriptors
from glm_ray.kernels.torch_ref.attention import ATTN_BYTES
from glm_ray.kernels.torch_ref.attention import mla_decode as ref_mla_decode
from glm_ray.kernels.torch_ref.attention import mla_prefill as ref_mla_prefill

try:
    from triton.testing import do_bench
except ImportError:                  # CUDA events below
    do_bench = None

COPY_TBPS = 4.2                      # H200 device-to-device copy rate measured here (docs/measurements)
R, DR = 512, 64
D = R + DR
SPARSE_K = 2048
REF_MAX_BYTES = 1 << 30
PREFILL_DIMS = {"glm5": (192, 64, 256), "glm53": (256, 0, 256)}   # (qk_nope, qk_rope, v): GLM-5 / 5.3-Flash


def _graphed(fn):
    """fn captured in a CUDA graph (decode runs under graphs: no host launch cost in the timing)."""
    fn()                                                                    # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _time_ms(fn, iters: int, graph: bool = True) -> float:
    """Median milliseconds of one CUDA-graph replay of fn (or of fn itself, `graph=False`), the L2
    flushed before each."""
    fn = _graphed(fn) if graph else fn
    if do_bench is not None:
        return float(do_bench(fn, warmup=5, rep=max(20, iters), return_mode="median"))
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        flush.zero_()
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in ev)[iters // 2]


def _case(B: int, h: int, ctx: int, block_size: int, sparse: bool, dev: torch.device, g: torch.Generator):
    nb = -(-ctx // block_size)
    block_table = torch.randperm(B * nb, generator=g).view(B, nb).int()      # shuffled blocks
    kv_cache = torch.randn(B * nb * block_size, D, device=dev, dtype=torch.bfloat16)
    q = torch.randn(B, h, D, device=dev, dtype=torch.bfloat16)
    context_lens = torch.full((B,), ctx, dtype=torch.int32)
    indices = None
    if sparse:
        indices = torch.stack([torch.randperm(ctx, generator=g)[:SPARSE_K] for _ in range(B)]).int()   # [B, K]
        indices = indices.to(dev)
    return q, kv_cache, block_table, context_lens, indices


def _reference_bytes(B: int, h: int, ctx: int) -> int:
    """One-shot transient of the torch reference: gathered rows, the bool mask expanded per head, fp32
    scores and probabilities, the int64 slots."""
    return B * ctx * (D * 2 + h * (1 + 8) + 8)


def _measure(h: int, B: int, ctx: int, sparse: bool, block_size: int, iters: int, reference: bool,
             g: torch.Generator, splits: int | None = None, config: tuple | None = None) -> dict:
    dev = torch.device("cuda")
    scale = 192 ** -0.5
    q, kv, bt, cl, idx = _case(B, h, ctx, block_size, sparse, dev, g)
    bt_d, cl_d = bt.to(dev), cl.to(dev)
    keys = min(ctx, SPARSE_K) if sparse else ctx
    nbytes = B * keys * D * 2 + B * h * (D + R) * 2                         # cache rows + q in + o_lat out
    auto = default_num_splits(B, h, D, SPARSE_K if sparse else bt.shape[1] * block_size,
                              config[0] if config else None)
    try:
        ms = _time_ms(lambda: mla_decode_paged(q, kv, bt_d, cl_d, block_size, kv_lora_rank=R, scale=scale,
                                               indices=idx, num_splits=splits, config=config), iters)
    except Exception as e:                                                  # a config the compiler rejects
        if config is None:
            raise
        return {"h": h, "B": B, "context": ctx, "mode": "sparse" if sparse else "dense",
                "config": _config_name(config), "error": f"{type(e).__name__}: {str(e)[:120]}"}
    row = {"h": h, "B": B, "context": ctx, "mode": "sparse" if sparse else "dense", "keys": keys,
           "config": _config_name(config),
           "splits": auto if splits is None else splits, "auto_splits": auto,
           "us": ms * 1e3, "MB": nbytes / 1e6, "TB_s": nbytes / ms / 1e9,
           "tflops": 2 * B * h * keys * (D + R) / ms / 1e9}
    row["copy_ratio"] = row["TB_s"] / COPY_TBPS
    row["ref_us"] = float("nan")
    if reference and _reference_bytes(B, h, ctx) <= REF_MAX_BYTES:
        grp = build_forward_batch([1] * B, [ctx] * B, bt.tolist(), block_size, dev, mla_mode="absorbed").groups[0]
        sel = None if idx is None else idx[:, None, :]                       # [B, 1, K]
        row["ref_us"] = _time_ms(lambda: ref_mla_decode(q, kv, grp, sel, kv_lora_rank=R, scale=scale),
                                 max(5, iters // 4), graph=False) * 1e3
    row["speedup"] = row["ref_us"] / row["us"]
    return row


def _config_name(config: tuple | None) -> str:
    return "table" if config is None else ":".join(str(int(v)) for v in config)


def _decode_config(text: str) -> tuple | None:
    """'table' -> None; 'BH:BN:WARPS:STAGES[:WS]' -> the `mla_decode_paged` config tuple."""
    if text == "table":
        return None
    parts = text.split(":")
    if len(parts) not in (4, 5) or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected BH:BN:WARPS:STAGES[:WS] or 'table'")
    return tuple(int(p) for p in parts)


@torch.inference_mode()
def run(heads: list[int], batches: list[int], contexts: list[int], sparse_contexts: list[int], block_size: int,
        iters: int, reference: bool, splits: list[int] | None = None, configs: list | None = None) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    shapes = [(c, False) for c in contexts] + [(c, True) for c in sparse_contexts]
    splits = splits or [0]                                                  # 0: the heuristic's
    configs = configs or [None]                                             # None: the per-shape table's
    for h in heads:
        n0 = len(rows)
        for B in batches:
            for ctx, sparse in shapes:
                for sp in splits:                                            # the reference timed once
                    for ci, cfg in enumerate(configs):                      # interleaved per shape
                        rows.append(_measure(h, B, ctx, sparse, block_size, iters,
                                             reference and sp == splits[0] and ci == 0, g, sp or None, cfg))
        print_rows(rows[n0:], COLS, width=10)                                # one table per head count
        print(flush=True)
    return rows


COLS = ["h", "B", "context", "mode", "config", "splits", "auto_splits", "us", "MB", "TB_s", "copy_ratio", "tflops", "ref_us", "speedup", "error"]


# --------------------------------------------------------------------------------------------
# prefill
# --------------------------------------------------------------------------------------------

def _prefill_case(h: int, B: int, L: int, prefix: int, dims: tuple[int, int, int], block_size: int, sparse: bool,
                  dev: torch.device, g: torch.Generator):
    """q [B*L, h, dn+dr], cache, kv_b weight, the one prefill group of the step, and the DSA selection."""
    dn, dr, dv = dims
    ctx = prefix + L
    nb = -(-ctx // block_size)
    tables = torch.randperm(B * nb, generator=g).view(B, nb).tolist()        # shuffled blocks
    groups = build_forward_batch([L] * B, [ctx] * B, tables, block_size, dev).groups
    assert len(groups) == 1                                                 # equal lengths: one bucket
    grp = groups[0]
    q = torch.randn(B * L, h, dn + dr, device=dev, dtype=torch.bfloat16)
    cache = torch.randn(B * nb * block_size, R + dr, device=dev, dtype=torch.bfloat16)
    w = torch.randn(h * (dn + dv), R, device=dev, dtype=torch.bfloat16) * R ** -0.5
    sel = None
    if sparse:                                                              # top-k of random causal scores
        scores = torch.rand(grp.causal.shape, device=dev).masked_fill_(~grp.causal, float("-inf"))
        v, i = scores.topk(min(SPARSE_K, ctx), dim=-1)
        sel = torch.where(v == float("-inf"), -1, i).to(torch.int32)        # [B, L, k]
        del scores, v, i
    return q, cache, w, grp, sel


def _measure_prefill(h: int, B: int, L: int, prefix: int, dims: tuple[int, int, int], sparse: bool,
                     block_size: int, iters: int, reference: bool, config, g: torch.Generator,
                     tiles: SparseTiles = SparseTiles(), key_tma: bool = False, head_group: int | None = None) -> dict:
    dev = torch.device("cuda")
    dn, dr, dv = dims
    q, cache, w, grp, sel = _prefill_case(h, B, L, prefix, dims, block_size, sparse, dev, g)
    scale = (dn + dr) ** -0.5
    kw = dict(kv_lora_rank=R, v_head_dim=dv, scale=scale)
    def kv_b(x):
        return F.linear(x, w)
    descs = mla_key_descriptors if key_tma else None
    ms = _time_ms(lambda: mla_prefill_group(q, cache, grp, sel, kv_b, max_bytes=ATTN_BYTES, config=config,
                                            tiles=tiles, key_descriptors=descs, head_group=head_group, **kw),
                  iters, graph=False)
    ctx = prefix + L
    slots = grp.kv_slots.reshape(-1)                                        # [B * ctx]: the packed rows here
    expand_ms = _time_ms(lambda: kv_b(cache[slots][:, :R]), iters, graph=False)
    pairs = B * (L * prefix + L * (L + 1) // 2)                             # causal (query, key) pairs
    attn_flop = 2 * pairs * h * (dn + dr + dv)
    expand_flop = 2 * B * ctx * R * h * (dn + dv)
    attn_ms = max(ms - expand_ms, 1e-6)
    mode = ((f"sparse:{tiles_name(tiles)}" if sparse else "dense") + (":tma" if key_tma else "")
            + (f":hg{head_group}" if head_group else ""))
    row = {"h": h, "B": B, "L": L, "prefix": prefix, "mode": mode, "us": ms * 1e3,
           "expand_us": expand_ms * 1e3, "attn_us": attn_ms * 1e3,
           "tflops": (attn_flop + expand_flop) / ms / 1e9, "attn_tflops": attn_flop / attn_ms / 1e9}
    row["peak_ratio"] = row["attn_tflops"] / PEAK_BF16_TFLOPS
    row["ref_us"] = float("nan")
    if reference:
        row["ref_us"] = _time_ms(lambda: ref_mla_prefill(q, cache, grp, sel, kv_b, max_bytes=REF_MAX_BYTES, **kw),
                                 max(3, iters // 10), graph=False) * 1e3
    row["speedup"] = row["ref_us"] / row["us"]
    return row


@torch.inference_mode()
def run_prefill(heads: list[int], shapes: list[tuple[int, int]], prefix: int, dims: tuple[int, int, int],
                block_size: int, iters: int, reference: bool, config, tiles: list[SparseTiles] | None = None,
                sparse_only: bool = False, key_loads: tuple[str, ...] = ("pointer",),
                head_groups: tuple[int | None, ...] = (None,)) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for h in heads:
        n0 = len(rows)
        for B, L in shapes:
            sparse = prefix + L > SPARSE_K
            for key_tma, hg in ((k == "tma", hg) for k in key_loads for hg in head_groups):   # interleaved: one process
                if hg is not None and h % hg:
                    continue
                if not (sparse and sparse_only):
                    rows.append(_measure_prefill(h, B, L, prefix, dims, False, block_size, iters, reference, config,
                                                 g, key_tma=key_tma, head_group=hg))
                for t in (tiles or [SparseTiles()]) if sparse else ():
                    rows.append(_measure_prefill(h, B, L, prefix, dims, True, block_size, iters, reference, config,
                                                 g, tiles=t, key_tma=key_tma, head_group=hg))
        print_rows(rows[n0:], PREFILL_COLS, width=11)                       # one table per head count
        print(flush=True)
    return rows


PREFILL_COLS = ["h", "B", "L", "prefix", "mode", "us", "expand_us", "attn_us", "tflops", "attn_tflops", "peak_ratio",
                "ref_us", "speedup"]


def tiles_name(t: SparseTiles) -> str:
    return "skip" if t.skip_empty else "noskip"


TILES = {tiles_name(t): t for t in (SparseTiles(skip) for skip in (False, True))}


def _shape(text: str) -> tuple[int, int]:
    try:
        b, n = text.lower().split("x")
        return int(b), int(n)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected BxL, e.g. 4x8192") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["decode", "prefill"], default="decode", help="which kernel to time")
    p.add_argument("--heads", type=int, nargs="+", default=[16, 32, 64], help="query heads per rank (h)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64], help="decode sequences (B)")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768], help="dense context lengths")
    p.add_argument("--sparse-contexts", type=int, nargs="*", default=[8192, 32768],
                   help=f"context lengths of the sparse (K={SPARSE_K}) rows")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--prefill-shapes", type=_shape, nargs="+", default=[(1, 1024), (8, 1024), (1, 8192), (4, 8192)],
                   metavar="BxL", help="prefill mode: B fresh prompts of L tokens each")
    p.add_argument("--prefix", type=int, default=0, help="prefill mode: cached tokens before each prompt")
    p.add_argument("--prefill-dims", choices=list(PREFILL_DIMS), default="glm5",
                   help="prefill mode: head dims, glm5 = qk 192+64 / v 256, glm53 = NoPE qk 256 / v 256")
    p.add_argument("--config", type=int, nargs=4, default=None, metavar=("BM", "BN", "WARPS", "STAGES"),
                   help="prefill mode: one kernel config instead of the table's")
    p.add_argument("--sparse-tiles", choices=list(TILES), nargs="+", default=None,
                   help="prefill mode: time the sparse rows once per way of walking the tiles")
    p.add_argument("--sparse-only", action="store_true", help="prefill mode: no dense rows for sparse shapes")
    p.add_argument("--key-loads", choices=["pointer", "tma"], nargs="+", default=["pointer"],
                   help="prefill mode: time every row once per way of loading the key tiles (pointer tiles, or TMA "
                        "boxes through tensor descriptors: GLM_RAY_CUDA_MLA_PREFILL_TMA)")
    p.add_argument("--head-groups", type=int, nargs="+", default=None,
                   help="prefill mode: time every row once per launch order (`mla_prefill` head_group: 1 = head by "
                        "head, n = n heads' tiles interleaved, heaviest first; unset: the default)")
    p.add_argument("--no-reference", action="store_true", help="skip the torch reference timings")
    p.add_argument("--splits", type=int, nargs="+", default=None,
                   help="decode mode: time each of these split-K counts per row (0: the heuristic's)")
    p.add_argument("--decode-configs", type=_decode_config, nargs="+", default=None,
                   help="decode mode: kernel configs BH:BN:WARPS:STAGES[:WS] ('table' = the shipped per-shape one), "
                        "timed interleaved per shape (WS 1: warp-specialized key loop)")
    p.add_argument("--json", default=None, help="also append the rows to this JSONL file")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("glm_ray.bench.attention needs a CUDA GPU")
    if a.mode == "prefill":
        rows = run_prefill(a.heads, a.prefill_shapes, a.prefix, PREFILL_DIMS[a.prefill_dims], a.block_size, a.iters,
                           not a.no_reference, tuple(a.config) if a.config else None,
                           [TILES[n] for n in a.sparse_tiles] if a.sparse_tiles else None, a.sparse_only,
                           tuple(a.key_loads), tuple(a.head_groups) if a.head_groups else (None,))
    else:
        rows = run(a.heads, a.batch, a.contexts, a.sparse_contexts, a.block_size, a.iters, not a.no_reference, a.splits,
                   a.decode_configs)
    append_rows(a.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
