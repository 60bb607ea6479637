"""The committed decode benchmark: per (model, mode, batch, context) the host ms and device ms of one
decode step, the step's memory-bandwidth floor and how far above it the step runs, and the top device ops.

    python -m glm_ray.bench.decode glm5-flash-31b glm5-slice-6l --batch 1 8 32 64 --context 1024 8192 \
        --steps 20 --mode eager graph --quant fp8 --device cuda --json decode.jsonl --profile-top 12

One engine (`Worker`, dummy weights, TP1) per (model, mode), so weights load once; `--mode graph` only
turns `EngineConfig.enforce_eager` off (the runner decides what it captures). Per (batch B, context C),
B sequences that already hold C tokens are faked without a prefill: the caches are filled with random
values once, and the requests enter through the runner's normal `execute(SchedulerOutput)` diff (new
requests, a block table of ceil(C/bs) blocks, start_pos = C - 1, one token each); every further step
feeds each sequence its greedy token at the next position and appends a block at block boundaries.
Warm-up steps (graph capture) are not timed; the requests are finished before the next case.

Two phases per row. The synchronous one times `execute(step)` = launch + the host's wait for the sampled
ids, step after step, so its step is host + device. The served engine on a GPU at TP1 schedules
asynchronously (README "async scheduling"; engine_core.py `_step_async`): step N+1 is built and launched
before step N's ids are read back, its tokens -1 placeholders the runner takes from step N's token tensor
on the device, so a served step costs ~max(host, device). With `--overlap` (default) a second phase
(`OverlapDecodeCase`) drives the runner that way, on fresh requests from the same start state (same
prompts, block tables, state slots; recurrent states restored; positions >= C-1 are rewritten before
they are read), and checks its greedy ids step by step against the synchronous phase's.

Per row:
* step_ms — median wall time of `execute` (the runner's host sync on the sampled tokens included);
* replay_call_ms — host time inside the graph replay call (cudaGraphLaunch) per step, unprofiled;
* host_split_ms — medians of the runner's own step timings (`ModelRunnerOutput.timings`): `prepare` (request
  state, token ids, the eager path's batch build and copy), `forward` (the forward's launches, or the graph
  path's input staging + replay call; the logits' launch), `sample` (sampling's launches, the wait for the
  ids, the outputs);
* host_ms — step_ms minus the time the host waited for the device: on CUDA the runner's `sample` is
  wrapped to synchronize right after sampling is launched, and that wait is subtracted (the host's own
  work: inputs, launches or graph replay, sampling bookkeeping); on CPU the host does everything;
* device_ms — sum of the CUDA kernel (and memcpy/memset) time per step from `torch.profiler` over
  `--profile-steps` extra steps (NaN on CPU); if the profiler sees no kernels, the CUDA-event span of
  `execute` instead (`device_src` says which);
* floor_ms — the bytes a step must read (`floor_bytes`) over `--bandwidth` (4.2e12 B/s: an H200's
  achievable HBM read rate); ratio_wall = step_ms / floor_ms, ratio_device = device_ms / floor_ms;
* top_ops — with `--profile-top N`, the N ops with the most device time per step (CPU self time on CPU);
* timeline_ms (CUDA) — where a profiled step's wall time goes: GPU busy, the GPU's gaps between the step's
  kernels, host time before the first kernel and after the last (see `profile_steps_of`);
* overlap_step_ms — the overlapped phase's step: the MEDIAN of the per-step intervals (wall time between
  consecutive returns of one engine iteration: build diff N+1, launch N+1, wait for and apply step N's ids)
  over `--steps` timed steps after max(1, --warmup) untimed ones; overlap_mean_ms (JSON) = total wall /
  steps; overlap_ratio_wall = overlap_step_ms / floor_ms; NaN with --no-overlap;
* overlap_tokens_match — the overlapped phase's sampled ids equal the synchronous phase's at every step
  (greedy, same kernels: the same bits); False is printed as a WARNING line, overlap_mismatch_step (JSON)
  is the first step that differs (1 = the first placeholder step: its id read from the wrong step).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import re
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from glm_ray import kernels
from glm_ray.bench.gaps import GapGroup, gap_groups, print_gap_groups
from glm_ray.bench.table import append_rows, print_rows
from glm_ray.config import ModelConfig, make_engine_config
from glm_ray.engine.contract import ModelRunnerOutput, NewRequestData, ScheduledSeq, SchedulerOutput
from glm_ray.engine.sampling_params import SamplingParams
from glm_ray.layers.mla import MLAAttention
from glm_ray.layers.moe import FusedMoE
from glm_ray.model.tiny import resolve_model
from glm_ray.worker import model_runner as runner_module
from glm_ray.worker.cache import kv_bytes_per_token, state_bytes
from glm_ray.worker.worker import Worker

HBM_BYTES_PER_S = 4.2e12            # H200: achievable HBM read bandwidth (4.8e12 peak)
# the block-FP8 [128, 128] checkpoint format (zai-org GLM FP8 releases; quant/config.py parses it)
FP8_QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}
ROW_COLS = ["model", "quant", "mode", "batch", "context", "step_ms", "host_ms", "replay_call_ms", "device_ms", "floor_ms",
            "ratio_wall", "ratio_device", "tokens_per_s", "graph_steps", "overlap_step_ms", "overlap_ratio_wall",
            "overlap_tokens_match"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _elem(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


# ---- the floor ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightBytes:
    """Weight bytes of one rank's decode step, split by how often a step reads them."""
    dense: int            # every step: attention (absorbed W_UK/W_UV, not kv_b_proj), index keys' wk, dense
    #                       MLPs, shared experts, routers, norms
    per_expert: int       # one routed expert of one MoE layer (gate + up + down, with scales)
    moe_layers: int
    num_experts: int
    top_k: int
    indexer_query: int    # full-indexer layers' query side (wq_b, weights_proj): read only while scoring
    lm_head: int
    embed_row: int        # one token's embedding row

    def expert_bytes(self, batch: int) -> float:
        """Routed experts read by `batch` tokens, each picking top_k of E uniformly at random."""
        if not self.moe_layers:
            return 0.0
        return self.moe_layers * expected_distinct_experts(self.num_experts, self.top_k, batch) * self.per_expert


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """E * (1 - (1 - K/E)^B): the expected number of distinct experts B uniform top-K picks touch."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def weight_bytes_from_config(cfg: ModelConfig) -> WeightBytes:
    """The weight bytes of a GLM-5 / GLM-4.7-Flash decode step at TP1, from the config alone, in checkpoint
    format: bf16 (the model dtype) or block FP8 (1 byte per weight + one fp32 scale per block, each fused
    shard with its own scale rows). The lm_head, routers, norms, indexer weights_proj and the absorbed
    W_UK/W_UV stay unquantized, as in every GLM checkpoint. Raises NotImplementedError for what it does
    not model (KDA / mHC layers, other quant methods, ignored_layers): use `weight_bytes_from_model`."""
    if cfg.linear_attention_layers() or cfg.hc_mult:
        raise NotImplementedError("KDA / mHC layers: count the model's parameters instead")
    qc = cfg.quantization_config
    block = None
    if qc is not None:
        if qc.get("quant_method") != "fp8" or not qc.get("weight_block_size") or qc.get("ignored_layers"):
            raise NotImplementedError(f"quantization_config {qc.get('quant_method')!r}: count the model's parameters")
        block = tuple(qc["weight_block_size"])
    e = _elem(cfg.dtype)

    def lin(out_sizes: list[int], k: int) -> int:        # a quantizable linear [sum(out_sizes), k]
        n = sum(out_sizes)
        if block is None:
            return n * k * e
        bn, bk = block
        return n * k + sum(_cdiv(s, bn) for s in out_sizes) * _cdiv(k, bk) * 4

    D, H, r = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    dn, dr, dv, rq = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
    E, Im = cfg.n_routed_experts, cfg.moe_intermediate_size
    dense = idx_q = moe_layers = 0
    for layer in range(cfg.num_hidden_layers):
        dense += 2 * D * e                                                   # input / post-attention norms
        if rq:
            dense += lin([rq], D) + rq * e + lin([H * (dn + dr)], rq)       # q_a_proj, q_a_layernorm, q_b_proj
        else:
            dense += lin([H * (dn + dr)], D)                                 # q_proj
        dense += lin([r + dr], D) + r * e                                    # kv_a_proj_with_mqa, kv_a_layernorm
        dense += H * dn * r * e + H * r * dv * e                             # absorbed W_UK, W_UV (model dtype)
        dense += lin([D], H * dv)                                            # o_proj
        if cfg.indexer_types[layer] == "full":
            di, hi = cfg.index_head_dim, cfg.index_n_heads
            dense += lin([di], D) + 2 * di * e                               # wk, k_norm (weight + bias)
            idx_q += lin([hi * di], rq) + hi * D * 4                         # wq_b, weights_proj (fp32)
        if cfg.mlp_layer_types[layer] == "sparse":
            moe_layers += 1
            dense += E * D * 4 + E * 4                                       # router weight + correction bias
            if cfg.n_shared_experts:
                Is = Im * cfg.n_shared_experts
                dense += lin([Is, Is], D) + lin([D], Is)
        else:
            I = cfg.intermediate_size  # noqa: E741
            dense += lin([I, I], D) + lin([D], I)
    dense += D * e                                                           # final norm
    per_expert = lin([Im, Im], D) + lin([D], Im) if moe_layers else 0
    return WeightBytes(dense=dense, per_expert=per_expert, moe_layers=moe_layers, num_experts=E,
                       top_k=cfg.num_experts_per_tok, indexer_query=idx_q, lm_head=cfg.vocab_size * D * e,
                       embed_row=D * e)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def weight_bytes_from_model(model: torch.nn.Module, cfg: ModelConfig) -> WeightBytes:
    """The same split counted from a built model's parameters (runtime layout, padding included). The
    MTP layers (index >= num_hidden_layers) are skipped: built, not run; kv_b_proj is replaced by the
    absorbed W_UK / W_UV the decode reads."""
    def nbytes(ts) -> int:
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    dense = idx_q = lm = embed_row = per_expert = moe_layers = 0
    E = cfg.n_routed_experts
    for name, mod in model.named_modules():
        m = _LAYER.search(name)
        if m and int(m.group(1)) >= cfg.num_hidden_layers:
            continue
        own = list(mod.parameters(recurse=False))
        if isinstance(mod, FusedMoE):
            moe_layers += 1
            E = mod.num_experts
            per_expert = nbytes(own) // mod.num_experts
        elif name.endswith("kv_b_proj"):
            continue
        elif isinstance(mod, MLAAttention):
            dense += nbytes(own) + nbytes([mod.w_kc, mod.w_vc])
        elif name.endswith("lm_head"):
            lm += nbytes(own)
        elif name.endswith("embed_tokens"):
            embed_row = nbytes(own) // max(1, own[0].shape[0]) if own else 0
        elif name.endswith(("indexer.wq_b", "indexer.weights_proj")):
            idx_q += nbytes(own)
        else:
            dense += nbytes(own)
    return WeightBytes(dense=dense, per_expert=per_expert, moe_layers=moe_layers, num_experts=E,
                       top_k=cfg.num_experts_per_tok, indexer_query=idx_q, lm_head=lm, embed_row=embed_row)


def floor_bytes(w: WeightBytes, cfg: ModelConfig, batch: int, context: int, cache_elem: int = 2) -> dict[str, float]:
    """Bytes one decode step of `batch` sequences at `context` tokens must read (TP1):
    weights (dense + the expected distinct routed experts + the indexer's query side while it scores),
    the lm_head, the embedding rows, the latent KV (per attention layer B * min(C, index_topk) rows with
    DSA scoring, else B * C rows, kv_cache_dim wide) and, while the indexer scores (C > index_topk), the
    index keys (per full-indexer layer B * C rows of index_cache_dim). `cache_elem`: bytes per cache value."""
    scoring = cfg.has_indexer and context > cfg.index_topk
    weights = w.dense + w.expert_bytes(batch) + (w.indexer_query if scoring else 0) + batch * w.embed_row
    kv = 0
    for layer in cfg.attention_layers():
        rows = min(context, cfg.index_topk) if scoring and cfg.indexer_types[layer] != "none" else context
        kv += batch * rows * cfg.kv_cache_dim * cache_elem
    index = batch * context * cfg.index_cache_dim * cache_elem * len(cfg.full_indexer_layers()) if scoring else 0
    total = weights + w.lm_head + kv + index
    return {"weights": float(weights), "lm_head": float(w.lm_head), "kv": float(kv), "index_keys": float(index),
            "total": float(total)}


# ---- the engine -----------------------------------------------------------------------------------
def model_dir_for(model: str, quant: str, root: Path) -> Path:
    """A directory holding `model`'s config.json (any name `resolve_model` takes) with the quantization
    config replaced: block FP8 [128, 128] (`fp8`) or none (`bf16`)."""
    hf = json.loads((Path(resolve_model(model)) / "config.json").read_text())
    hf.pop("quantization_config", None)
    if quant == "fp8":
        hf["quantization_config"] = dict(FP8_QUANT_CONFIG)
    elif quant != "bf16":
        raise ValueError(f"quant must be fp8 or bf16, got {quant!r}")
    d = root / Path(model).name.removesuffix(".json")
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(hf, indent=2))
    return d


def steps_per_case(warmup: int, steps: int, profile_steps: int) -> int:
    """Decode steps one case runs at most: warm-up (at least the registering step), timed, profiled (or
    the CUDA-event fallback's one step). The overlapped phase launches fewer (warm-up + timed)."""
    return max(1, warmup) + steps + max(1, profile_steps)


def build_worker(model_dir: Path, *, device: str, dtype: str, mode: str, max_batch: int, max_context: int,
                 steps_total: int, block_size: int = 16, seed: int = 0, piecewise_max_tokens: int = 0) -> Worker:
    """A TP1 `Worker` with dummy weights and a KV cache of exactly max_batch sequences of
    max_context - 1 + steps_total tokens (cache values random, see module docstring). mode "eager": no
    CUDA graphs; else decode graphs, and piecewise prefill graphs up to `piecewise_max_tokens` (0: none)."""
    resolved = "float32" if dtype == "auto" and device == "cpu" else dtype          # as Worker.load_model
    mcfg = ModelConfig.from_pretrained(model_dir, resolved)
    need = max_batch * _cdiv(max_context - 1 + steps_total, block_size)
    budget = (need * block_size * kv_bytes_per_token(mcfg, mcfg.dtype)
              + state_bytes(mcfg, mcfg.dtype, max_batch, 1))
    cfg = make_engine_config(str(model_dir), dtype=dtype, device=device, load_format="dummy",
                             max_num_seqs=max_batch, max_model_len=max_context + steps_total,
                             block_size=block_size, kv_cache_memory_bytes=budget, seed=seed,
                             fp8_proj_gemm=False, enforce_eager=mode == "eager",
                             max_num_batched_tokens=max(2048, piecewise_max_tokens),
                             piecewise_graph_max_tokens=piecewise_max_tokens)
    w = Worker(cfg)
    w.init_device()
    w.load_model()
    n = w.determine_num_blocks()
    if n < need:
        raise RuntimeError(f"KV cache holds {n} blocks, the largest case needs {need}")
    w.init_cache(n)
    g = torch.Generator(device=w.device).manual_seed(seed + 1)
    with torch.no_grad():
        for t in [c for c in w.runner.kv_caches if c is not None] + list(w.runner.index_caches.values()):
            t.normal_(generator=g)                   # real-looking latents / index keys, not zeros
    return w


def dummy_worker(model: str, quant: str, **kw) -> Worker:
    """`build_worker` for a model name / config in `quant`'s checkpoint format (the config written to a
    temporary directory, removed once the worker is built)."""
    tmp = Path(tempfile.mkdtemp(prefix="glm-ray-bench-"))
    try:
        return build_worker(model_dir_for(model, quant, tmp), **kw)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def release(device: str) -> None:
    """After the bench dropped its worker: collect it and return its memory to the device."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


class SyncWaitProbe:
    """Measures how long the host waits for the device inside `execute` (CUDA only): wraps the runner's
    `sample` so that right after sampling is launched the host synchronizes, timed. The runner's own
    host sync on the sampled tokens then finds the work done. Not installed (`active` False) on CPU or
    when the runner has no `sample`; never synchronizes inside a CUDA-graph capture."""

    def __init__(self, cuda: bool):
        self.cuda, self.active, self.wait_s = cuda, False, 0.0

    def take(self) -> float:
        w, self.wait_s = self.wait_s, 0.0
        return w

    @contextlib.contextmanager
    def installed(self):
        orig = getattr(runner_module, "sample", None)
        if not self.cuda or orig is None:
            yield self
            return

        def timed_sample(*args, **kwargs):
            out = orig(*args, **kwargs)
            if not torch.cuda.is_current_stream_capturing():
                t0 = time.perf_counter()
                torch.cuda.synchronize()
                self.wait_s += time.perf_counter() - t0
            return out
        runner_module.sample, self.active = timed_sample, True
        try:
            yield self
        finally:
            runner_module.sample, self.active = orig, False


class DecodeCase:
    """B fake sequences at context C driven through `execute` one decode step at a time (synchronously:
    each step's sampled ids are read back before the next step is built). `history`: the sampled ids of
    every step so far, [steps][B]."""

    def __init__(self, worker: Worker, batch: int, context: int, steps_total: int, tag: str, seed: int = 0):
        self.worker, self.B, self.C = worker, batch, context
        self.bs = worker.runner.block_size
        nb = _cdiv(context - 1 + steps_total, self.bs)                       # blocks per sequence, all steps
        g = torch.Generator().manual_seed(seed * 1_000_003 + batch * 100_003 + context)
        prompts = torch.randint(0, worker.model_cfg.vocab_size, (batch, context), generator=g)   # [B, C]
        self.rids = [f"{tag}-b{batch}-c{context}-{i}" for i in range(batch)]
        self.tables = [list(range(i * nb, (i + 1) * nb)) for i in range(batch)]
        params = SamplingParams(temperature=0.0, max_tokens=steps_total + 1, ignore_eos=True)
        self.new = [NewRequestData(rid, p, params) for rid, p in zip(self.rids, prompts.tolist())]
        self.tokens = prompts[:, -1].tolist()                                # next input token per sequence
        self.pos = context - 1                                               # its position
        self.first = True
        self.history: list[list[int]] = []                                   # [steps][B] sampled ids

    def next_step(self) -> SchedulerOutput:
        """The scheduler's diff for the next step (built outside the timed call; per sequence, as the
        scheduler does)."""
        seqs = []
        for i, rid in enumerate(self.rids):
            if self.first:
                blocks, reset = self.tables[i][:_cdiv(self.C, self.bs)], True
            elif self.pos % self.bs == 0:
                blocks, reset = [self.tables[i][self.pos // self.bs]], False
            else:
                blocks, reset = [], False
            seqs.append(ScheduledSeq(rid, [self.tokens[i]], self.pos, blocks, reset, sample=True, state_slot=i))
        return SchedulerOutput(new_requests=self.new if self.first else [], seqs=seqs)

    def _sampled(self, out: ModelRunnerOutput | None) -> list[int]:
        """The next collected step's sampled ids (per sequence), appended to `history`."""
        if out is None or out.failed:
            why = next(iter(out.failed.values())).message if out is not None and out.failed else "no output"
            raise RuntimeError(f"decode step {len(self.history)} at B={self.B}, C={self.C} failed: {why}")
        toks = [out.sampled[rid] for rid in self.rids]
        self.history.append(toks)
        return toks

    def advance(self, out: ModelRunnerOutput | None) -> None:
        self.tokens = self._sampled(out)
        self.pos += 1
        self.first = False

    def step(self) -> None:
        so = self.next_step()
        self.advance(self.worker.execute(so))

    def finish(self) -> None:
        self.worker.execute(SchedulerOutput(finished_req_ids=list(self.rids)))


PLACEHOLDER = -1        # a decode token still being sampled (engine/scheduler.py `_schedule_seq`, async_mode)


class OverlapDecodeCase(DecodeCase):
    """The same fake sequences driven the way the async engine drives the runner (engine_core.py
    `_step_async`, the scheduler's `async_mode`): one `step()` builds step N+1's diff, `launch`es it, then
    `collect`s step N (the host's one wait) and applies its ids. When step N+1 is built its input tokens
    are unknown, so every decode token after the first is the scheduler's -1 placeholder (the runner takes
    it from step N's token tensor on the device); position and blocks advance at launch, as the
    scheduler's `num_computed_tokens` does, and the diff carries `share_tokens` as the engine's does.
    `drain()` collects the step still in flight after the last `step()`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pending = None                               # the runner's PendingStep launched, not collected

    def step(self) -> None:
        so = self.next_step()                             # the prompt's last token, then placeholders
        so.share_tokens = True
        launched = self.worker.launch(so)
        self.tokens = [PLACEHOLDER] * self.B
        self.pos += 1
        self.first = False
        prev, self.pending = self.pending, launched
        if prev is not None:
            self._sampled(self.worker.collect(prev))

    def drain(self) -> None:
        prev, self.pending = self.pending, None
        if prev is not None:
            self._sampled(self.worker.collect(prev))

    def finish(self) -> None:
        prev, self.pending = self.pending, None
        if prev is not None:                              # an error path: clear it, its ids unread
            self.worker.collect(prev)
        super().finish()


def run_overlapped(worker: Worker, *, batch: int, context: int, steps_total: int, tag: str, seed: int, warmup: int,
                   steps: int) -> tuple[list[float], OverlapDecodeCase, int]:
    """The overlapped phase of a row: max(1, warmup) untimed `OverlapDecodeCase.step()`s (the pipeline
    fills: one step always in flight), then `steps` timed ones. Returns the per-step intervals in s (the
    wall time between consecutive `step()` returns: build diff N+1, launch N+1, wait for and apply N, so
    in steady state the served step period), the drained case (its `history`) and the timed launches
    that replayed a graph."""
    case = OverlapDecodeCase(worker, batch, context, steps_total, tag, seed)
    runner = worker.runner
    intervals: list[float] = []
    try:
        for _ in range(max(1, warmup)):
            case.step()
        g0 = runner.num_graph_steps
        t_prev = time.perf_counter()
        for _ in range(steps):
            case.step()
            t = time.perf_counter()
            intervals.append(t - t_prev)
            t_prev = t
        graph_steps = runner.num_graph_steps - g0
        case.drain()
    finally:
        case.finish()
    return intervals, case, graph_steps


def first_mismatch(ref: list[list[int]], got: list[list[int]]) -> int | None:
    """The first step whose ids in `got` differ from `ref`'s same step (or that `ref` lacks); None if none."""
    for i, ids in enumerate(got):
        if i >= len(ref) or ref[i] != ids:
            return i
    return None


def snapshot_states(worker: Worker, batch: int) -> list[torch.Tensor]:
    """Host copies of state slots 0..batch-1 of every recurrent-state cache (KDA layers; none for MLA-only
    models): a decode step updates them in place, so a second run from the same start restores them."""
    return [t[:batch].to("cpu", copy=True) for pair in worker.runner.state_caches.values() for t in pair]


def restore_states(worker: Worker, batch: int, saved: list[torch.Tensor]) -> None:
    tensors = [t for pair in worker.runner.state_caches.values() for t in pair]
    with torch.no_grad():
        for t, s in zip(tensors, saved):
            t[:batch].copy_(s)


def profile_steps_of(case, n: int, cuda: bool, top: int, trace: str | None = None
                     ) -> tuple[float, list[dict], str, dict, list[dict]]:
    """Run n steps of `case` (a `DecodeCase`, or any object whose `step()` runs one engine step: bench.prefill's
    `PrefillCase`) under torch.profiler: (device ms per step, top ops, source of the device time, timeline,
    the GPU's idle gaps grouped by host event (`bench.gaps`)). `trace`: also write a Chrome trace there.

    timeline (CUDA; per-step medians, ms): `gpu_busy` (kernel time), `gpu_span` (first kernel start to
    last kernel end of the step), `gpu_gaps` (span - busy: the GPU idle *between* the step's kernels,
    e.g. a graph's launch gaps), `host_before` (step start to the first kernel: input staging and the
    launch / graph replay call), `host_after` (last kernel end to step end: reading the tokens back and
    the host's bookkeeping), `graph_launch` (CPU time inside cudaGraphLaunch)."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(n):
            with record_function("glm_ray_bench_step"):
                case.step()
        if cuda:
            torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    agg: dict[str, list[float]] = {}
    timeline: dict[str, float] = {}
    gaps: list[dict] = []
    if cuda:
        kernels_t = []
        for ev in prof.events():                                  # kernels, memcpy, memset
            if ev.device_type == DeviceType.CUDA and ev.name != "glm_ray_bench_step":   # not the annotation's range
                a = agg.setdefault(ev.name, [0, 0.0])
                a[0] += 1
                a[1] += ev.time_range.elapsed_us()
                kernels_t.append((ev.time_range.start, ev.time_range.end))
        timeline = _timeline(prof.events(), kernels_t)
        gaps = [asdict(g) for g in gap_groups(prof.events(), n)]
    else:
        for ev in prof.key_averages():                            # CPU ops by self time
            if ev.self_cpu_time_total > 0:
                agg[ev.key] = [ev.count, ev.self_cpu_time_total]
    total = sum(v[1] for v in agg.values())
    ops = [{"name": k, "calls_per_step": c / n, "ms_per_step": us / n / 1e3, "share": us / total if total else 0.0}
           for k, (c, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]]
    if not cuda:
        return float("nan"), ops, "none", timeline, gaps
    if total > 0:
        return total / n / 1e3, ops, "profiler", timeline, gaps
    return float("nan"), ops, "none", timeline, gaps


def _timeline(events, kernels_t: list[tuple[float, float]]) -> dict[str, float]:
    """Per-step split of a profiled step's wall time (see `profile_steps_of`), medians over the steps, in ms.
    Kernels belong to the step during whose [start, next step's start) they start (profiler clocks
    are one timeline for host and device events)."""
    steps = sorted((ev.time_range.start, ev.time_range.end) for ev in events
                   if ev.device_type == DeviceType.CPU and ev.name == "glm_ray_bench_step")
    launches = [(ev.time_range.start, ev.time_range.elapsed_us()) for ev in events
                if ev.device_type == DeviceType.CPU and ev.name == "cudaGraphLaunch"]
    rows = {k: [] for k in ("gpu_busy", "gpu_span", "gpu_gaps", "host_before", "host_after", "graph_launch")}
    for i, (s0, s1) in enumerate(steps):
        nxt = steps[i + 1][0] if i + 1 < len(steps) else float("inf")
        ks = sorted(k for k in kernels_t if s0 <= k[0] < nxt)
        if not ks:
            continue
        busy, first, last = sum(e - b for b, e in ks), ks[0][0], max(e for _, e in ks)
        rows["gpu_busy"].append(busy)
        rows["gpu_span"].append(last - first)
        rows["gpu_gaps"].append(last - first - busy)
        rows["host_before"].append(first - s0)
        rows["host_after"].append(max(0.0, s1 - last))
        rows["graph_launch"].append(sum(d for t, d in launches if s0 <= t < s1))
    return {k: statistics.median(v) / 1e3 for k, v in rows.items() if v}


def _event_span_ms(case: DecodeCase, n: int) -> float:
    """Fallback device time: CUDA-event span of each step's `execute` (idle gaps included)."""
    spans = []
    for _ in range(n):
        so = case.next_step()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = case.worker.execute(so)
        b.record()
        case.advance(out)
        b.synchronize()
        spans.append(a.elapsed_time(b))
    return statistics.median(spans)


def run_case(worker: Worker, weights: WeightBytes, *, model: str, quant: str, mode: str, batch: int, context: int,
             steps: int, warmup: int = 3, profile_steps: int = 5, profile_top: int = 12,
             bandwidth: float = HBM_BYTES_PER_S, seed: int = 0, overlap: bool = True) -> dict:
    """One row: the synchronous phase (timed, then profiled), then with `overlap` (where the worker has
    `launch` / `collect`) the overlapped phase on fresh requests from the same start state, whose ids
    are checked against the synchronous phase's."""
    cuda = worker.device.type == "cuda"
    total = steps_per_case(warmup, steps, profile_steps)
    overlap = overlap and hasattr(worker, "launch") and hasattr(worker, "collect")
    saved = snapshot_states(worker, batch) if overlap else []
    case = DecodeCase(worker, batch, context, total, f"{model}-{mode}", seed)
    probe = SyncWaitProbe(cuda)
    walls, waits, cpus, replays, splits = [], [], [], [], []
    try:
        for _ in range(max(1, warmup)):                           # the first step registers the requests
            case.step()
        g0 = worker.runner.num_graph_steps
        with probe.installed():
            for _ in range(steps):
                so = case.next_step()
                probe.take()
                c0, t0 = time.thread_time(), time.perf_counter()
                r0 = worker.runner.graphs.replay_s if worker.runner.graphs is not None else 0.0
                out = worker.execute(so)
                if worker.runner.graphs is not None:
                    replays.append(worker.runner.graphs.replay_s - r0)
                walls.append(time.perf_counter() - t0)
                cpus.append(time.thread_time() - c0)
                waits.append(probe.take())
                splits.append(out.timings if out is not None else {})
                case.advance(out)
            host_src = "wall-minus-sync" if (probe.active or not cuda) else "thread-cpu"
        graph_steps = worker.runner.num_graph_steps - g0                # timed steps that replayed a graph
        device_ms, ops, dev_src, timeline, gaps = float("nan"), [], "none", {}, []
        if profile_steps and (cuda or profile_top):
            device_ms, ops, dev_src, timeline, gaps = profile_steps_of(case, profile_steps, cuda, profile_top)
        if cuda and math.isnan(device_ms):
            device_ms, dev_src = _event_span_ms(case, max(1, profile_steps)), "events"
    finally:
        case.finish()
    ovl_walls, ovl_case, ovl_graphs = [], None, 0
    if overlap:
        restore_states(worker, batch, saved)
        ovl_walls, ovl_case, ovl_graphs = run_overlapped(worker, batch=batch, context=context, steps_total=total,
                                                         tag=f"{model}-{mode}-overlap", seed=seed, warmup=warmup,
                                                         steps=steps)
    step_ms = statistics.median(walls) * 1e3
    if host_src == "thread-cpu":                 # no probe: CPU time (a spinning device wait counts)
        host_ms = statistics.median(cpus) * 1e3
    else:
        host_ms = statistics.median(w - s for w, s in zip(walls, waits)) * 1e3
    fb = floor_bytes(weights, worker.model_cfg, batch, context, _elem(worker.model_cfg.dtype))
    floor_ms = fb["total"] / bandwidth * 1e3
    ovl_ms = statistics.median(ovl_walls) * 1e3 if ovl_walls else float("nan")
    mismatch = first_mismatch(case.history, ovl_case.history) if ovl_case is not None else None
    return {"model": model, "quant": quant, "mode": mode, "batch": batch, "context": context, "steps": steps,
            "step_ms": step_ms, "host_ms": host_ms, "host_split_ms": host_split(splits),
            "replay_call_ms": statistics.median(replays) * 1e3 if replays else float("nan"), "sync_wait_ms": statistics.median(waits) * 1e3,
            "device_ms": device_ms, "floor_ms": floor_ms, "ratio_wall": step_ms / floor_ms,
            "ratio_device": device_ms / floor_ms, "tokens_per_s": batch / step_ms * 1e3,
            "floor_gb": fb["total"] / 1e9, "floor_weights_gb": (fb["weights"] + fb["lm_head"]) / 1e9,
            "floor_kv_gb": (fb["kv"] + fb["index_keys"]) / 1e9, "host_src": host_src, "device_src": dev_src,
            "top_ops_time": "device" if cuda else "cpu", "top_ops": ops, "timeline_ms": timeline, "gaps": gaps,
            "final_pos": case.pos, "device": str(worker.device), "graph_steps": graph_steps,
            "fallbacks": fallback_counts(),
            "overlap_step_ms": ovl_ms, "overlap_ratio_wall": ovl_ms / floor_ms,
            "overlap_mean_ms": sum(ovl_walls) / len(ovl_walls) * 1e3 if ovl_walls else float("nan"),
            "overlap_tokens_per_s": batch / ovl_ms * 1e3,
            "overlap_tokens_match": (mismatch is None) if ovl_case is not None else None,
            "overlap_mismatch_step": mismatch, "overlap_graph_steps": ovl_graphs,
            "overlap_steps_checked": len(ovl_case.history) if ovl_case is not None else 0}


def host_split(timings: list[dict[str, float]]) -> dict[str, float]:
    """Medians in ms of the runner's prepare / forward / sample timings over the timed steps."""
    return {k: statistics.median(t.get(k, 0.0) for t in timings) * 1e3 for k in ("prepare", "forward", "sample")
            if timings and any(k in t for t in timings)}


def fallback_counts() -> dict[str, int]:
    """The kernel backend's reference fallbacks so far ("op: reason" -> calls): a row whose decode
    kernels fell back measures the reference, and says so."""
    counter = getattr(getattr(kernels.ops().block_fp8_linear, "__self__", None), "fallbacks", None)
    return {f"{op}: {why}": n for (op, why), n in (counter or {}).items()}


def warn_mismatch(row: dict) -> None:
    if row.get("overlap_tokens_match") is False:
        print(f"  WARNING: B={row['batch']} C={row['context']}: the overlapped phase's ids differ from the synchronous "
              f"phase's from step {row['overlap_mismatch_step']} on (a placeholder read from the wrong step?)")


def print_ops(row: dict) -> None:
    if row.get("host_split_ms"):
        print("  runner host split (ms, medians): " + ", ".join(f"{k} {v:.3f}" for k, v in row["host_split_ms"].items()))
    if row.get("timeline_ms"):
        print("  step timeline (ms, profiled): " + ", ".join(f"{k} {v:.3f}" for k, v in row["timeline_ms"].items()))
    print_gap_groups([GapGroup(**g) for g in row.get("gaps", [])])
    if not row["top_ops"]:
        return
    shape = f"B={row['batch']} C={row['context']}" if "context" in row else f"B={row['batch']} L={row['length']}"
    print(f"  top {row['top_ops_time']} ops: {row['model']} {row['quant']} {row.get('mode', 'eager')} {shape}")
    print(f"  {'share':>6} {'ms/step':>8} {'calls/step':>10}  name")
    for op in row["top_ops"]:
        name = op["name"] if len(op["name"]) <= 90 else op["name"][:87] + "..."
        print(f"  {op['share']:>6.1%} {op['ms_per_step']:>8.3f} {op['calls_per_step']:>10.1f}  {name}")


def run(models: list[str], batches: list[int], contexts: list[int], *, steps: int = 20,
        modes: tuple[str, ...] = ("eager", "graph"), quant: str = "fp8", device: str = "auto", dtype: str = "auto",
        warmup: int = 3, profile_steps: int = 5, profile_top: int = 12, bandwidth: float = HBM_BYTES_PER_S,
        block_size: int = 16, seed: int = 0, verbose: bool = True, overlap: bool = True) -> list[dict]:
    """Every (model, mode, context, batch) row; one engine per (model, mode)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    total = steps_per_case(warmup, steps, profile_steps)
    for model in models:
        for mode in modes:
            worker = dummy_worker(model, quant, device=device, dtype=dtype, mode=mode, max_batch=max(batches),
                                  max_context=max(contexts), steps_total=total, block_size=block_size, seed=seed)
            try:
                weights = weight_bytes_from_config(worker.model_cfg)
            except NotImplementedError:
                weights = weight_bytes_from_model(worker.model, worker.model_cfg)
            for C in contexts:
                for B in batches:
                    row = run_case(worker, weights, model=model, quant=quant, mode=mode, batch=B, context=C,
                                   steps=steps, warmup=warmup, profile_steps=profile_steps,
                                   profile_top=profile_top, bandwidth=bandwidth, seed=seed, overlap=overlap)
                    row["weights"] = asdict(weights)
                    rows.append(row)
                    if verbose:
                        print_rows([row], ROW_COLS, width=14)
                        print_ops(row)
                        warn_mismatch(row)
            del worker
            release(device)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="*", default=["glm5-flash-31b"], metavar="MODEL",
                   help="bundled config names (glm5-flash-31b, glm5-slice-6l, glm5-tiny, ...), config.json files "
                        "or model directories; weights are always dummy")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--context", type=int, nargs="+", default=[1024, 8192], help="tokens already in the cache")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per row")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (graph capture)")
    p.add_argument("--profile-steps", type=int, default=5, help="extra profiled steps per row (device time)")
    p.add_argument("--profile-top", type=int, default=12, help="device ops listed per row (0: none)")
    p.add_argument("--mode", nargs="+", choices=["eager", "graph"], default=["eager", "graph"])
    p.add_argument("--quant", choices=["fp8", "bf16"], default="fp8", help="fp8: block-FP8 [128,128] checkpoint format")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--bandwidth", type=float, default=HBM_BYTES_PER_S, help="bytes/s of the floor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also append the rows to this JSONL file")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the overlapped (async-scheduling) step: launch N+1 before collecting N")
    a = p.parse_args(argv)
    if min(a.batch) < 1 or min(a.context) < 1 or a.steps < 1:
        p.error("--batch, --context and --steps must be >= 1")
    rows = run(a.models, a.batch, a.context, steps=a.steps, modes=tuple(a.mode), quant=a.quant, device=a.device,
               dtype=a.dtype, warmup=a.warmup, profile_steps=a.profile_steps, profile_top=a.profile_top,
               bandwidth=a.bandwidth, block_size=a.block_size, seed=a.seed, overlap=a.overlap)
    print()
    print_rows(rows, ROW_COLS, width=14)
    for row in rows:
        warn_mismatch(row)
    append_rows(a.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
