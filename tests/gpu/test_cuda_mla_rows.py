"""The Triton absorbed MLA over runs of one sequence's rows (`glm_ray.kernels.cuda.mla_rows.mla_decode_runs`) on
the GPU at glm5-flash-31b's shapes (skipped without an NVIDIA GPU): r = 512, dr = 64, h = 32 (2 rows a program)
and 16 (4 rows), bf16, block size 64. A mixed step's decode group: chunk tails of 128 / 37 rows over a 2,048-token
cached prefix beside 15 decode rows, dense and DSA (K = 2048: the tails' contexts are <= 2K, so their tiles walk
the context under the rows' bitmaps), and tails over a 5k prefix (past 2K: row-by-row index walks).

Oracle: `mla_decode_reference` (fp32 math on the same bf16 inputs); tolerance as tests/gpu/test_cuda_mla_decode.py
(rel-norm <= 1e-2 and max abs err <= 2e-2 * max|ref| per row): a wrong or missing key moves a row by > 5%.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or getattr(torch.version, "hip", None) is not None,
                                 reason="no NVIDIA GPU present")]

from glm_ray.bench.attention import _tails_case  # noqa: E402
from glm_ray.kernels.cuda.mla_decode import mla_decode_reference  # noqa: E402
from glm_ray.kernels.cuda.mla_rows import mla_decode_runs  # noqa: E402

R = 512
SCALE = 192 ** -0.5


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    o, r = out.float(), ref.float()
    assert torch.isfinite(o).all()
    for b in range(o.shape[0]):                                               # per row: nothing diluted
        rel = float((o[b] - r[b]).norm() / r[b].norm())
        mx = float((o[b] - r[b]).abs().max() / r[b].abs().max())
        assert rel <= 1e-2 and mx <= 2e-2, (b, rel, mx)


@pytest.mark.parametrize("h", [32, 16])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("prefix,shape", [(2048, (1, 128)), (2048, (2, 37)), (5000, (1, 64))])
def test_runs_match_reference(h, sparse, prefix, shape):
    S, L = shape
    q, kv, bt, cl, first, lens, idx = _tails_case(h, S, L, prefix, 15, 64, sparse, torch.Generator().manual_seed(h))
    out = mla_decode_runs(q, kv, bt, cl, 64, first, lens, prefix + L, kv_lora_rank=R, scale=SCALE, indices=idx)
    ref = mla_decode_reference(q, kv, bt, cl, 64, kv_lora_rank=R, scale=SCALE, indices=idx)
    assert_close(out, ref)
