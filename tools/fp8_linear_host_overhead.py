"""Host (Python) time per call of the cuda backend's block-FP8 linear wrapper, on the CPU: the device
checks are bypassed and the two kernels (Triton act quant, `_scaled_mm`) replaced by allocations, so
what is timed is what the wrapper adds to each launch-bound projection call on a GPU host (plus the
stubs' CPU allocations, which grow with the output: the [1024, 16384] case is mostly that).

    python tools/fp8_linear_host_overhead.py
"""
import time

import torch

from glm_ray.kernels.cuda import layout as L
from glm_ray.kernels.cuda.ops import CudaKernels
from glm_ray.kernels.torch_ref.fp8 import quant_weight_ue8m0


class _StubKernels:
    @staticmethod
    def act_quant_fp8(x, m_out, k_out, ue8m0, col_major_scale):
        return torch.empty(m_out, k_out, dtype=torch.float8_e4m3fn), torch.empty(k_out // 128, m_out).t()


ck = CudaKernels()
ck._gpu_reason = lambda *a, **k: None
ck.tk = _StubKernels
ck._scaled_mm = lambda xq, xs, wp, sp: torch.empty(xq.shape[0], wp.shape[0], dtype=torch.bfloat16)
for name, n, k in (("flash q_b_proj", 8192, 768), ("flash o_proj", 2048, 8192), ("slice q_b_proj", 16384, 2048)):
    q, s = quant_weight_ue8m0(torch.randn(n, k, dtype=torch.bfloat16), (128, 128))
    w, sc, meta = L.prepare_scaled_mm_weight(q, s)
    ck._selfcheck[(L.scaled_mm_padded_dims(n, k)[1], None)] = True
    x = torch.randn(1024, k, dtype=torch.bfloat16)
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(2000):
            ck.block_fp8_linear(x, w, sc, (128, 128), out_dtype=x.dtype, **meta)
        runs.append((time.perf_counter() - t) / 2000 * 1e6)
    print(f"{name:15s} [{n}, {k}]: {sorted(runs)[2]:.1f} us/call (median of 5 x 2000){'' if not ck.fallbacks else ' FALLBACK'}")
