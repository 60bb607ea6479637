"""The prefill-step benchmark (issue #20's first measure): per (model, B x L) the wall, host and device ms
of one step that prefills B fresh L-token prompts, its compute floor, and how far above it the step runs.

    python -m glm_ray.bench.prefill glm5-flash-31b glm5-slice-6l --shape 1x1024 8x1024 1x8192 4x8192 \
        --quant fp8 --device cuda --json prefill.jsonl --profile-top 12

One TP1 `Worker` per model (dummy weights). `--modes eager piecewise` (the default) runs each shape both
ways in the same process, interleaved: eager, and through the piecewise CUDA graphs
(worker/piecewise_graph.py; steps of up to `--piecewise-max-tokens` tokens, larger ones stay eager and
their piecewise row says so: `pieces` 0). Each timed step
registers B new requests with their whole prompts as one chunk (start 0, the blocks of one table per
sequence) through the runner's `execute(SchedulerOutput)` diff, and finishes the previous step's
requests in the same diff. Per row:
* step_ms, host_ms, host_split_ms, sync_wait_ms — as in `bench.decode` (host_ms = the wall time minus the host's wait
  for the device right after sampling; CPU: the host does everything);
* device_ms — kernel time per step from `torch.profiler` (`--profile-steps` extra steps; NaN on CPU);
* flops — `prefill_flops`: the linears at one row per token (routed experts: top_k per token; kv_b_proj
  on every context token, the naive MLA prefill expands K/V; the indexer's query side only while it
  scores), causal attention (keys per query: position + 1, or index_topk past it under DSA), the
  indexer's scores (full-indexer layers, while it scores), the lm_head on the B sampled rows;
* floor_bf16_ms — all FLOPs at the measured bf16 GEMM rate (`MEASURED_BF16_TFLOPS`); floor_fp8_ms — the
  quantized linears at the measured block-FP8 rate (`MEASURED_FP8_TFLOPS`), the rest at bf16; `floor_ms`
  is the one of the checkpoint's format and ratio_wall / ratio_device divide by it. Issue #20's target:
  ratio_wall <= 2 at 8 x 1k and above.
`--prefill-selection bits indices` runs each (shape, mode) with the cuda backend's DSA selection in both forms
in turn (the `selection` column): the indexer's top-k writing the sparse MLA prefill's bitmap (the default) or
an index list the prefill kernel converts.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from glm_ray.bench.decode import (
    SyncWaitProbe,
    dummy_worker,
    fallback_counts,
    host_split,
    print_ops,
    profile_steps_of,
    release,
)
from glm_ray.bench.gpu_timing import MEASURED_BF16_TFLOPS, MEASURED_FP8_TFLOPS
from glm_ray.bench.table import append_rows, print_rows
from glm_ray.config import ModelConfig
from glm_ray.engine.contract import ModelRunnerOutput, NewRequestData, ScheduledSeq, SchedulerOutput
from glm_ray.engine.sampling_params import SamplingParams
from glm_ray.worker.worker import Worker

ROW_COLS = ["model", "quant", "mode", "selection", "batch", "length", "step_ms", "host_ms", "device_ms", "floor_ms", "ratio_wall",
            "ratio_device", "tflops_wall", "floor_bf16_ms", "floor_fp8_ms"]


# ---- the floor ------------------------------------------------------------------------------------
def _keys(length: int, cap: int | None) -> int:
    """Sum over the L query positions p of the keys each attends: p + 1, at most `cap`."""
    if cap is None or length <= cap:
        return length * (length + 1) // 2
    return cap * (cap + 1) // 2 + (length - cap) * cap


def prefill_flops(cfg: ModelConfig, batch: int, length: int) -> dict[str, float]:
    """FLOPs of one TP1 step prefilling `batch` fresh prompts of `length` tokens (multiply-add = 2),
    split into `linear_quant` (the linears a block-FP8 checkpoint quantizes), `linear_bf16` (routers,
    the indexer's weights_proj, the lm_head), `attention` and `indexer` (the DSA scores). GLM-5 / GLM-4.7
    layer shapes (MLA + DSA + MoE); raises NotImplementedError for KDA / mHC layers."""
    if cfg.linear_attention_layers() or cfg.hc_mult:
        raise NotImplementedError("KDA / mHC layers are not modelled")
    T = batch * length
    D, H, r = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    dn, dr, dv, rq = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
    scoring = cfg.has_indexer and length > cfg.index_topk
    quant = plain = attn = index = 0                       # parameters touched per token / FLOPs
    for layer in range(cfg.num_hidden_layers):
        quant += (rq * D + H * (dn + dr) * rq) if rq else H * (dn + dr) * D   # q_a_proj + q_b_proj | q_proj
        quant += (r + dr) * D + H * (dn + dv) * r + D * H * dv                # kv_a_proj, kv_b_proj (expand), o_proj
        kind = cfg.indexer_types[layer]
        if kind == "full":
            di, hi = cfg.index_head_dim, cfg.index_n_heads
            quant += di * D                                                   # wk: every token's index key
            if scoring:
                quant += hi * di * rq                                         # wq_b
                plain += hi * D                                               # weights_proj
                index += 2 * batch * _keys(length, None) * hi * di
        cap = cfg.index_topk if scoring and kind != "none" else None
        attn += 2 * batch * _keys(length, cap) * H * (dn + dr + dv)           # QK^T + PV
        if cfg.mlp_layer_types[layer] == "sparse":
            Im = cfg.moe_intermediate_size
            plain += cfg.n_routed_experts * D                                 # router
            quant += 3 * Im * D * (cfg.num_experts_per_tok + (cfg.n_shared_experts or 0))
        else:
            quant += 3 * cfg.intermediate_size * D
    out = {"linear_quant": 2.0 * T * quant, "linear_bf16": 2.0 * T * plain + 2.0 * batch * cfg.vocab_size * D,
           "attention": float(attn), "indexer": float(index)}
    out["total"] = sum(out.values())
    return out


def floors_ms(flops: dict[str, float], bf16_tflops: float = MEASURED_BF16_TFLOPS,
              fp8_tflops: float = MEASURED_FP8_TFLOPS) -> tuple[float, float]:
    """(all at the bf16 rate, the quantized linears at the FP8 rate and the rest at bf16), in ms."""
    bf16 = flops["total"] / (bf16_tflops * 1e12) * 1e3
    fp8 = (flops["linear_quant"] / (fp8_tflops * 1e12) + (flops["total"] - flops["linear_quant"])
           / (bf16_tflops * 1e12)) * 1e3
    return bf16, fp8


# ---- the case -------------------------------------------------------------------------------------
class PrefillCase:
    """B fresh L-token prompts prefilled in one step, again and again (new request ids each step)."""

    def __init__(self, worker: Worker, batch: int, length: int, tag: str, seed: int = 0):
        self.worker, self.B, self.L, self.tag = worker, batch, length, tag
        nb = -(-length // worker.runner.block_size)                         # blocks per prompt
        g = torch.Generator().manual_seed(seed * 1_000_003 + batch * 100_003 + length)
        self.prompts = torch.randint(0, worker.model_cfg.vocab_size, (batch, length), generator=g).tolist()
        self.tables = [list(range(i * nb, (i + 1) * nb)) for i in range(batch)]
        self.params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        self.n, self.live = 0, []

    def next_step(self) -> SchedulerOutput:
        """New requests with their whole prompts; the previous step's requests finished (blocks reused)."""
        self.n += 1
        rids = [f"{self.tag}-b{self.B}-l{self.L}-{self.n}-{i}" for i in range(self.B)]
        so = SchedulerOutput(new_requests=[NewRequestData(rid, p, self.params) for rid, p in zip(rids, self.prompts)],
                             seqs=[ScheduledSeq(rid, p, 0, self.tables[i], True, sample=True, state_slot=i)
                                   for i, (rid, p) in enumerate(zip(rids, self.prompts))],
                             finished_req_ids=self.live)
        self.live = rids
        return so

    def advance(self, out: ModelRunnerOutput | None) -> None:
        if out is None or out.failed or set(out.sampled) != set(self.live):
            why = next(iter(out.failed.values())).message if out is not None and out.failed else "no tokens"
            raise RuntimeError(f"prefill step at B={self.B}, L={self.L} failed: {why}")

    def step(self) -> None:
        so = self.next_step()
        self.advance(self.worker.execute(so))

    def finish(self) -> None:
        self.worker.execute(SchedulerOutput(finished_req_ids=self.live))
        self.live = []


def run_case(worker: Worker, *, model: str, quant: str, batch: int, length: int, steps: int, warmup: int = 1,
             profile_steps: int = 2, profile_top: int = 12, seed: int = 0, mode: str = "eager",
             trace: str | None = None) -> dict:
    """One row: `mode` "eager" runs the step without the runner's piecewise graphs, "piecewise" with them
    (when the runner has them and the step fits). `trace`: a folder for the profiled steps' Chrome traces."""
    cuda = worker.device.type == "cuda"
    runner = worker.runner
    pieces = runner.pieces
    if mode == "eager":
        runner.pieces = None
    n_pieces = runner.num_piecewise_steps
    case = PrefillCase(worker, batch, length, f"{model}-{mode}", seed)
    probe = SyncWaitProbe(cuda)
    walls, waits, splits = [], [], []
    try:
        for _ in range(max(1, warmup)):
            case.step()
        with probe.installed():
            for _ in range(steps):
                so = case.next_step()
                probe.take()
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = worker.execute(so)
                walls.append(time.perf_counter() - t0)
                waits.append(probe.take())
                splits.append(out.timings if out is not None else {})
                case.advance(out)
        device_ms, ops, dev_src, timeline, gaps = float("nan"), [], "none", {}, []
        if profile_steps and (cuda or profile_top):
            trace_path = f"{trace}/{model}_{mode}_{batch}x{length}.json" if trace else None
            device_ms, ops, dev_src, timeline, gaps = profile_steps_of(case, profile_steps, cuda, profile_top, trace_path)
    finally:
        case.finish()
        runner.pieces = pieces
    step_ms = statistics.median(walls) * 1e3
    host_ms = statistics.median(w - s for w, s in zip(walls, waits)) * 1e3 if (probe.active or not cuda) else float("nan")
    flops = prefill_flops(worker.model_cfg, batch, length)
    f_bf16, f_fp8 = floors_ms(flops)
    floor = f_fp8 if quant == "fp8" else f_bf16
    return {"model": model, "quant": quant, "mode": mode, "pieces": runner.num_piecewise_steps - n_pieces,
            "batch": batch, "length": length, "tokens": batch * length,
            "steps": steps, "step_ms": step_ms, "host_ms": host_ms, "host_split_ms": host_split(splits), "sync_wait_ms": statistics.median(waits) * 1e3,
            "device_ms": device_ms, "floor_ms": floor, "floor_bf16_ms": f_bf16, "floor_fp8_ms": f_fp8,
            "ratio_wall": step_ms / floor, "ratio_device": device_ms / floor,
            "tflops_wall": flops["total"] / step_ms / 1e9, "flops": flops, "device_src": dev_src,
            "top_ops_time": "device" if cuda else "cpu", "top_ops": ops, "timeline_ms": timeline, "gaps": gaps,
            "device": str(worker.device), "fallbacks": fallback_counts()}


def run(models: list[str], shapes: list[tuple[int, int]], *, steps: int = 3, quant: str = "fp8",
        device: str = "auto", dtype: str = "auto", warmup: int = 1, profile_steps: int = 2, profile_top: int = 12,
        block_size: int = 16, seed: int = 0, verbose: bool = True, modes: tuple[str, ...] = ("eager", "piecewise"),
        piecewise_max_tokens: int = 8192, trace: str | None = None,
        selections: tuple[str, ...] = ("bits",)) -> list[dict]:
    """Every (model, shape, mode, selection) row; one engine per model, its KV cache sized for the largest
    shape; the modes of a shape run back to back in that engine, and within a mode the DSA selection forms
    (`selections`: "bits" — the indexer's top-k writes the sparse MLA prefill's bitmap, the cuda default —
    or "indices" — an index list the prefill kernel turns into its bitmap; an in-process A/B on the GPU)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    graphs = "piecewise" in modes
    for model in models:
        worker = dummy_worker(model, quant, device=device, dtype=dtype, mode="graph" if graphs else "eager",
                              max_batch=max(b for b, _ in shapes), max_context=max(n for _, n in shapes) + 1,
                              steps_total=1, block_size=block_size, seed=seed,
                              piecewise_max_tokens=piecewise_max_tokens if graphs else 0)
        pieces = worker.runner.pieces
        if verbose and pieces is not None and pieces.graphs:
            print(f"{model}: {len(pieces.graphs)} piecewise graphs (buckets {pieces.buckets[0]}..{pieces.buckets[-1]}) "
                  f"captured in {pieces.capture_s:.1f} s")
        for B, L in shapes:
            for mode in modes:
                for sel in selections:
                    _set_selection(device, sel)
                    row = run_case(worker, model=model, quant=quant, batch=B, length=L, steps=steps, warmup=warmup,
                                   profile_steps=profile_steps, profile_top=profile_top, seed=seed, mode=mode,
                                   trace=trace)
                    row["selection"] = sel
                    rows.append(row)
                    if verbose:
                        print_rows([row], ROW_COLS, width=13)
                        print_ops(row)
        _set_selection(device, "bits")
        del worker
        release(device)
    return rows


def _set_selection(device: str, form: str) -> None:
    """The cuda backend's prefill DSA selection form (kernels/cuda/ops.py `PREFILL_BITS`); other backends have one."""
    if str(device).startswith("cuda"):
        from glm_ray.kernels.cuda import ops  # noqa: PLC0415 - the cuda backend, only on a GPU
        ops.PREFILL_BITS = form == "bits"


def _shape(s: str) -> tuple[int, int]:
    b, _, n = s.lower().partition("x")
    if not (b.isdigit() and n.isdigit()) or int(b) < 1 or int(n) < 2:
        raise argparse.ArgumentTypeError(f"expected BxL with B >= 1, L >= 2 (e.g. 8x1024), got {s!r}")
    return int(b), int(n)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="*", default=["glm5-flash-31b"], metavar="MODEL",
                   help="bundled config names (glm5-flash-31b, glm5-slice-6l, glm5-tiny, ...), config.json files "
                        "or model directories; weights are always dummy")
    p.add_argument("--shape", type=_shape, nargs="+", default=[(1, 1024), (8, 1024), (1, 8192), (4, 8192)],
                   metavar="BxL", help="B fresh prompts of L tokens in one step")
    p.add_argument("--steps", type=int, default=3, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--profile-steps", type=int, default=2, help="extra profiled steps per row (device time)")
    p.add_argument("--profile-top", type=int, default=12, help="device ops listed per row (0: none)")
    p.add_argument("--quant", choices=["fp8", "bf16"], default="fp8", help="fp8: block-FP8 [128,128] checkpoint format")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", nargs="+", choices=["eager", "piecewise"], default=["eager", "piecewise"],
                   help="run each shape eagerly and/or through the piecewise CUDA graphs (GPU only: on the CPU "
                        "a piecewise row runs eagerly too and says so, pieces = 0)")
    p.add_argument("--piecewise-max-tokens", type=int, default=8192,
                   help="largest step captured as piecewise graphs (larger ones run eagerly)")
    p.add_argument("--json", default=None, help="also append the rows to this JSONL file")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="write each row's profiled steps as a Chrome trace into DIR")
    p.add_argument("--prefill-selection", nargs="+", choices=["bits", "indices"], default=["bits"],
                   help="the DSA selection form(s) the cuda prefill runs, each shape in each form in turn (A/B)")
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error("--steps must be >= 1")
    rows = run(a.models, a.shape, steps=a.steps, quant=a.quant, device=a.device, dtype=a.dtype, warmup=a.warmup,
               profile_steps=a.profile_steps, profile_top=a.profile_top, block_size=a.block_size, seed=a.seed,
               modes=tuple(a.modes), piecewise_max_tokens=a.piecewise_max_tokens, trace=a.trace,
               selections=tuple(a.prefill_selection))
    print()
    print_rows(rows, ROW_COLS, width=13)
    append_rows(a.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
