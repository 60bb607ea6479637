"""In-process A/B of the FP8 projection GEMM (issue 5): the model forward of one prefill step of M
tokens with the FP8 path on and off — same weights, same process, interleaved on/off/on/off — plus
the q_b_proj + o_proj GEMMs of every layer alone, so a step's delta can be read against the share of
the step those projections are. The served A/B (scripts/ab_fp8_proj.sh) compares two server
lifetimes; on a host-bound engine their spread can exceed the effect (seen on H200: see
docs/measurements), which this separates.

    python -m glm_ray.bench.fp8_proj_step glm5-slice-6l --load-format dummy --device cuda \
        --dtype bfloat16 --tokens 1024 2048 4096 8192 --seq-len 1024 --iters 10

The flag must be effective on the backend (aiter + gfx950, cuda + sm90); `GLM_RAY_FP8_PROJ_FORCE=1`
runs the FP8 path on the torch reference (CPU plumbing checks, not a speed claim).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from glm_ray.bench.table import append_rows, print_rows
from glm_ray.forward_batch import build_forward_batch, contiguous_block_tables
from glm_ray.llm import LLM
from glm_ray.quant.fp8_proj import Fp8ProjGemmMethod

_OFF = 1 << 62                      # min_tokens no batch exceeds: the bf16 path


def _clock(device: torch.device):
    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()
    return now


def _set(methods, on: bool, min_tokens: int) -> None:
    for m in methods:
        m.min_tokens = min_tokens if on else _OFF


@torch.inference_mode()
def run(model: str | None, tokens: list[int], seq_len: int, iters: int, **engine_kw) -> list[dict]:
    llm = LLM(model, fp8_proj_gemm=True, max_num_batched_tokens=max(tokens), executor="local", **engine_kw)
    w = llm.engine.executor.worker
    net, runner, dev = w.model, w.runner, w.device
    projs = [(mod, mod.quant_method) for mod in net.modules()
             if isinstance(getattr(mod, "quant_method", None), Fp8ProjGemmMethod)]
    if not projs:
        raise SystemExit("fp8_proj_gemm is not active on this backend (see the log line above); "
                         "GLM_RAY_FP8_PROJ_FORCE=1 runs the torch-reference FP8 path")
    methods = [m for _, m in projs]
    min_tokens = methods[0].min_tokens
    now, bs, V = _clock(dev), llm.config.cache.block_size, llm.engine.model_cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    rows = []
    for M in tokens:
        qlens = [seq_len] * (M // seq_len) + ([M % seq_len] if M % seq_len else [])
        tables = contiguous_block_tables(qlens, bs)
        nb = sum(map(len, tables))
        if nb > runner.num_slots // bs:
            raise SystemExit(f"M={M}: the KV cache holds {runner.num_slots // bs} blocks, {nb} needed")
        batch = build_forward_batch(qlens, qlens, tables, bs, dev, llm.config.mla_mode)
        ids = torch.randint(0, V, (M,), generator=g).to(dev)
        if M == tokens[0]:
            # the projections a step runs (the MTP layer's are built but not in the forward)
            ran: set[int] = set()
            hooks = [mod.register_forward_hook(lambda *_, key=id(mod): ran.add(key)) for mod, _ in projs]
            net(ids, batch, runner.kv_caches, runner.index_caches, runner.state_caches)
            for h in hooks:
                h.remove()
            projs = [(mod, m) for mod, m in projs if id(mod) in ran]
        xs = [torch.randn(M, mod.weight.shape[1], generator=g).to(dev, mod.weight.dtype) for mod, _ in projs]

        def step(on: bool) -> float:
            _set(methods, on, min_tokens)
            t0 = now()
            net(ids, batch, runner.kv_caches, runner.index_caches, runner.state_caches)               # [M, D]
            return now() - t0

        def gemms(on: bool) -> float:
            _set(methods, on, min_tokens)
            t0 = now()
            for (mod, m), x in zip(projs, xs):                                   # per layer, not per token
                m.apply(mod, x)
            return now() - t0

        for on in (True, False):                                                 # warm-up (autotune, caches)
            step(on), gemms(on)
        t = {True: [], False: []}
        p = {True: [], False: []}
        for i in range(iters):
            for on in ((True, False) if i % 2 == 0 else (False, True)):         # ABBA: no order bias
                t[on].append(step(on))
                p[on].append(gemms(on))
        # the switch is real: each projection's FP8 output vs its bf16 output on the same input
        err = 0.0
        for (mod, m), x in zip(projs, xs):
            _set([m], False, min_tokens)
            ref = m.apply(mod, x).float()
            _set([m], True, min_tokens)
            err = max(err, float((m.apply(mod, x).float() - ref).norm() / ref.norm()))
        def med(v):
            return statistics.median(v) * 1e3
        s_on, s_off, g_on, g_off = med(t[True]), med(t[False]), med(p[True]), med(p[False])
        rows.append({"model": model, "tokens": M, "seq_len": seq_len, "iters": iters, "num_projections": len(projs),
                     "step_ms_off": s_off, "step_ms_on": s_on, "step_delta": s_on / s_off - 1,
                     "proj_ms_off": g_off, "proj_ms_on": g_on, "proj_share_off": g_off / s_off,
                     "expected_step_delta": (g_on - g_off) / s_off,
                     "proj_max_rel_err": err})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192], help="M per step")
    p.add_argument("--seq-len", type=int, default=1024, help="prompt length the M tokens are split into")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--json", default=None, help="also append the rows to this JSONL file")
    a = p.parse_args(argv)
    rows = run(a.model, a.tokens, a.seq_len, a.iters, dtype=a.dtype, device=a.device, load_format=a.load_format)
    print_rows(rows, ["tokens", "step_ms_off", "step_ms_on", "step_delta", "proj_ms_off", "proj_ms_on",
                      "proj_share_off", "expected_step_delta", "proj_max_rel_err"], width=19)
    append_rows(a.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
