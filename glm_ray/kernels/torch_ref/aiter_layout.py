"""aiter memory-layout references (quant_contracts.md §2.4, §2.5, §3.5, §4.3).

These reproduce, in pure torch, the byte permutations aiter kernels expect, so that CPU contract
tests (and a fake `aiter` module) can check what the integration hands to the real kernels:

* `shuffle_weight(w, (16, 16))` — "bpreshuffle" weight layout for CK/asm/FlyDSL GEMMs and MoE.
  For 1-byte elements (fp8, packed fp4 viewed as uint8) element (n, k), n = 16*n0 + n1,
  k = 32*k0 + 16*k1 + k2, lands at flat offset ((n0*(K/32) + k0)*2 + k1)*256 + n1*16 + k2:
  16-row x 32-col tiles stored tile-row-major, each as two row-major 16x16 sub-tiles.
* `e8m0_shuffle(s)` — MXFP4 scale preshuffle: element (r, c), r = 32a + 16b + cc, c = 8d + 4e + f,
  lands at a*32*sn + d*256 + f*64 + cc*4 + e*2 + b in a `[ceil(m/256)*256, ceil(n/8)*8]` buffer.
* column-major activation scales `[M, K/128]` for `gemm_a8w8_blockscale_bpreshuffle`.
* SEPARATED <-> INTERLEAVE gate/up row order.
"""
from __future__ import annotations

import torch


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _as_bytes_dtype(w: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    """fp4x2 tensors are permuted as uint8 (same storage), then viewed back."""
    fp4x2 = getattr(torch, "float4_e2m1fn_x2", None)
    if fp4x2 is not None and w.dtype == fp4x2:
        return w.view(torch.uint8), w.dtype
    return w, w.dtype


def _shuffle_geometry(w: torch.Tensor, layout: tuple[int, int]) -> tuple[int, int, int, int, int]:
    tile_n, tile_k = layout
    bk = 2 * tile_k                        # K extent of a tile, in storage elements
    kp = 16 // w.element_size()            # elements per 16-byte row chunk
    n, k = w.shape[-2:]
    if n % tile_n or k % bk or bk % kp:
        raise ValueError(f"shuffle_weight: shape [..., {n}, {k}] needs N % {tile_n} == 0 and K % {bk} == 0 "
                         f"(element size {w.element_size()})")
    return n, k, tile_n, bk, kp


def shuffle_weight(w: torch.Tensor, layout: tuple[int, int] = (16, 16)) -> torch.Tensor:
    """aiter bpreshuffle.  w `[..., N, K]` (leading dims = experts, shuffled independently) -> same
    shape and dtype, bytes permuted; the result carries `is_shuffled = True` like aiter's."""
    x, dt = _as_bytes_dtype(w)
    n, k, tn, bk, kp = _shuffle_geometry(x, layout)
    y = x.reshape(-1, n // tn, tn, k // bk, bk // kp, kp).permute(0, 1, 3, 4, 2, 5).contiguous()
    y = y.view(x.shape)
    if dt != x.dtype:
        y = y.view(dt)
    y.is_shuffled = True
    return y


def unshuffle_weight(w: torch.Tensor, layout: tuple[int, int] = (16, 16)) -> torch.Tensor:
    """Inverse of `shuffle_weight`: `[..., N, K]` shuffled -> `[..., N, K]` row-major."""
    x, dt = _as_bytes_dtype(w)
    n, k, tn, bk, kp = _shuffle_geometry(x, layout)
    y = x.reshape(-1, n // tn, k // bk, bk // kp, tn, kp).permute(0, 1, 4, 2, 3, 5).contiguous()
    y = y.view(x.shape)
    return y.view(dt) if dt != x.dtype else y


def e8m0_shuffle(s: torch.Tensor) -> torch.Tensor:
    """aiter `e8m0_shuffle` (non-interleaved `shuffle_scale`) of E8M0 scale bytes.

    s `[m, n]` uint8 -> `[ceil(m/256)*256, ceil(n/8)*8]` (padding filled with 0; aiter leaves it
    uninitialised). A `[..., m, n]` input (MoE `[E, N, K/32]`) is flattened to `[E*m, n]` and viewed
    back, which requires no padding (E*m % 256 == 0 and n % 8 == 0, true for GLM dims).
    """
    lead = s.shape[:-2]
    m, n = s.shape[-2:]
    flat = s.reshape(-1, n)
    rows = flat.shape[0]
    sm, sn = _cdiv(rows, 256) * 256, _cdiv(n, 8) * 8
    if lead and (sm != rows or sn != n):
        raise ValueError(f"e8m0_shuffle: batched scales {tuple(s.shape)} would need padding "
                         f"(rows {rows} % 256, cols {n} % 8)")
    p = torch.zeros(sm, sn, dtype=s.dtype, device=s.device)
    p[:rows, :n] = flat
    out = p.view(sm // 32, 2, 16, sn // 8, 2, 4).permute(0, 3, 5, 2, 4, 1).contiguous().view(sm, sn)
    return out.view(s.shape) if lead else out


def e8m0_unshuffle(p: torch.Tensor, m: int | None = None, n: int | None = None) -> torch.Tensor:
    """Inverse of `e8m0_shuffle`: shuffled `[sm, sn]` (or `[..., m, n]` unpadded batch) -> `[m, n]`
    (cropped to the original m, n when given)."""
    lead = p.shape[:-2]
    cols = p.shape[-1]
    flat = p.reshape(-1, cols)
    sm, sn = flat.shape
    if sm % 256 or sn % 8:
        raise ValueError(f"e8m0_unshuffle: shape {tuple(p.shape)} is not a padded shuffled scale")
    out = flat.view(sm // 32, sn // 8, 4, 16, 2, 2).permute(0, 5, 3, 1, 4, 2).contiguous().view(sm, sn)
    if lead:
        return out.view(p.shape)
    return out[: (m if m is not None else sm), : (n if n is not None else sn)]


def x_scale_to_col_major(s: torch.Tensor) -> torch.Tensor:
    """Activation scales `[M, G]` -> same logical tensor with column-major strides `(1, M)`
    (bytes ordered `[G][M]`), as `gemm_a8w8_blockscale_bpreshuffle` wants."""
    return s.t().contiguous().t()


def x_scale_col_major_bytes(s: torch.Tensor) -> torch.Tensor:
    """The other accepted form: transposed bytes re-viewed row-major-looking, `s.t().contiguous().view(M, G)`.
    Element [i, j] of the result is NOT s[i, j]; only the byte order matters to the kernel."""
    m, g = s.shape
    return s.t().contiguous().view(m, g)


def x_scale_from_col_major_bytes(v: torch.Tensor) -> torch.Tensor:
    """Inverse of `x_scale_col_major_bytes`: `[M, G]` byte-transposed view -> logical `[M, G]`."""
    m, g = v.shape
    return v.contiguous().view(g, m).t().contiguous()


def interleave_gate_up_rows(w: torch.Tensor) -> torch.Tensor:
    """SEPARATED `[E, 2I, ...]` (gate rows, then up rows) -> INTERLEAVE (g0, u0, g1, u1, ...)."""
    i = w.shape[1] // 2
    return torch.stack([w[:, :i], w[:, i:]], 2).flatten(1, 2)


def deinterleave_gate_up_rows(w: torch.Tensor) -> torch.Tensor:
    """INTERLEAVE `[E, 2I, ...]` -> SEPARATED (gate rows, then up rows)."""
    return torch.cat([w[:, 0::2], w[:, 1::2]], 1)
