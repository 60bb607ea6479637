"""Kernel timing shared by the kernel benchmarks: one CUDA-graph replay per measurement (what a decode
step pays: no Python launch cost), optionally with the L2 evicted first; or eager calls (`eager_us`: what
an eager prefill step pays, launches included)."""
from __future__ import annotations

import statistics

import torch

PEAK_BF16_TFLOPS = 989.0             # H200 SXM datasheet, dense BF16 (no sparsity): the kernel benches' peak
# what GEMMs reach on the H200 machines (the prefill step's floor): an 8192^3 bf16 GEMM 721-798 TFLOP/s,
# a blockwise [1x128, 128x128] FP8 `_scaled_mm` 1.19-1.20 PFLOP/s
MEASURED_BF16_TFLOPS = 780.0
MEASURED_FP8_TFLOPS = 1200.0


def graph_replay_us(fn, iters: int, flush: torch.Tensor | None) -> float:
    """Median microseconds of one replay of `fn` captured in a CUDA graph; `flush` (a buffer larger than
    the L2) is zeroed before each replay so the operands come from HBM."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):                                   # warm-up: compile + allocator
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(iters):
        if flush is not None:
            flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def eager_us(fn, iters: int) -> float:
    """Median microseconds of one eager call of `fn` (CUDA events around it; two warm-up calls first;
    the L2 stays warm)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)
