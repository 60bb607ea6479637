"""GLM-5.3-Flash's chunked KDA prefill (op `kda_chunked`) on the GPU: the torch reference's loop over 64-token
chunks vs the Triton scan (GLM_RAY_CUDA_KDA_SCAN=triton), per KDA layer call, eager (what a prefill step pays,
launches included):

    python -m glm_ray.bench.kda [--tokens 1024 8192] [--batch 1 4] [--heads 64] [--iters 10] [--json out.jsonl]

Rows: per (B, L) the call's ms with each scan, the speedup, and the whole call's FLOP rate: the chunked form's
FLOPs (per chunk and head: the intra scores 2 * 2 * C^2 * dk, the triangular solve C^2 * (dk + dv), the scan's
four dots 2 * C * dk * dv * 3 + 2 * C^2 * dv) over the time, beside the measured bf16 GEMM rate (the kernels
run fp32 / 3xTF32, so the fraction says how far from tensor-core speed, not a roofline). Needs CUDA.
"""
from __future__ import annotations

import argparse

import torch

from glm_ray.bench.gpu_timing import MEASURED_BF16_TFLOPS, eager_us
from glm_ray.bench.table import append_rows, print_rows
from glm_ray.kernels.torch_ref.kda import kda_chunked_cached

COLS = ["B", "L", "heads", "torch_ms", "triton_ms", "speedup", "tflops_triton", "of_bf16_rate", "max_rel_err"]
C, DK = 64, 128


def chunked_flops(B: int, L: int, H: int, dk: int = DK, dv: int = DK, c: int = C) -> float:
    n = -(-L // c)
    per_chunk = 4 * c * c * dk + c * c * (dk + dv) + 6 * c * dk * dv + 2 * c * c * dv
    return float(B * H * n * per_chunk)


def run(tokens: list[int], batches: list[int], heads: int, iters: int) -> list[dict]:
    from glm_ray.kernels.cuda.kda import kda_chunk_scan  # noqa: PLC0415 (imports triton)
    rows = []
    for B in batches:
        for L in tokens:
            g = torch.Generator(device="cuda").manual_seed(L)
            def r(*s):
                return torch.randn(*s, device="cuda", generator=g)
            q, k, v = (r(B, L, heads, DK).bfloat16() for _ in range(3))
            gate = (-5.0 * torch.sigmoid(r(B, L, heads, DK))).bfloat16()
            beta = torch.rand(B, L, heads, device="cuda", generator=g).bfloat16()
            state = r(B, heads, DK, DK)
            slots, fresh = torch.arange(B, device="cuda"), torch.zeros(B, dtype=torch.bool, device="cuda")
            outs = {}
            def call(scan, name):
                s = state.clone()
                kw = {"scan": kda_chunk_scan} if scan else {}
                outs[name] = kda_chunked_cached(q, k, v, gate, beta, s, slots, fresh, **kw)
            t_torch = eager_us(lambda: call(False, "torch"), iters) / 1e3
            t_triton = eager_us(lambda: call(True, "triton"), iters) / 1e3
            a, b = outs["torch"].float(), outs["triton"].float()
            tf = chunked_flops(B, L, heads) / (t_triton * 1e-3) / 1e12
            rows.append({"B": B, "L": L, "heads": heads, "torch_ms": round(t_torch, 3), "triton_ms": round(t_triton, 3),
                         "speedup": round(t_torch / t_triton, 2), "tflops_triton": round(tf, 2),
                         "of_bf16_rate": round(tf / MEASURED_BF16_TFLOPS, 4),
                         "max_rel_err": float(((a - b).norm() / a.norm().clamp_min(1e-30)).item())})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--heads", type=int, default=64, help="KDA heads of one rank (GLM-5.3-Flash: 64 at TP1)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.kda needs CUDA")
    rows = run(a.tokens, a.batch, a.heads, a.iters)
    print_rows(rows, COLS)
    append_rows(a.json, rows)


if __name__ == "__main__":
    main()
