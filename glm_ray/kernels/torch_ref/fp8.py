"""Block-FP8 (e4m3) references: quantizers, dequantizers and the W8A8 block-scaled linear.

Block FP8 as DeepSeek-V3 / GLM checkpoints ship it (their `quantization_config` and reference code):

* weight  `w`  float8_e4m3fn `[N, K]`, `scale_inv` fp32 `[ceil(N/bn), ceil(K/bk)]` (block 128x128).
  Despite the name, `scale_inv` is the *dequant multiplier*: `W ~= w.float() * scale_inv` per block.
* activation: dynamic per-token-group (1 x 128) quant, `scale = max(amax, eps) / fp8_max`,
  `q = clamp(x * (1/scale), -fp8_max, fp8_max).to(e4m3)`; optional UE8M0 (power-of-two, ceil) scales.
* the GEMM reference dequantizes both operands and multiplies in fp32 (the kernels' per-K-block
  `acc += (xq_kb @ wq_kb^T) * xs_kb * ws_kb` is the same sum in a different order).

N and K need not be multiples of the block: scales are `ceil`-sized and the last block is partial
(quantizers pad with zeros, which never raise a block's amax).

Everything here is pure torch, runs on CPU and GPU, and is the oracle for the aiter/CUDA kernels.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn          # OCP e4m3 (gfx950, Hopper)
FP8_MAX = 448.0                          # finfo(e4m3fn).max
FP8_FNUZ_DTYPE = torch.float8_e4m3fnuz   # gfx942 (MI300)
FP8_FNUZ_MAX = 240.0                     # finfo(e4m3fnuz).max (SGLang/vLLM use 224 for dynamic act quant)
ACT_EPS = 1e-10                          # amax floor of dynamic activation quant (sglang triton / aiter HIP)
WEIGHT_AMAX_EPS = 1e-4                   # amax floor of block weight quant (DeepGEMM per_block_cast_to_fp8)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fp8_max_of(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


# --------------------------------------------------------------------------------------------
# UE8M0 (power-of-two) scales
# --------------------------------------------------------------------------------------------

def ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """Bit-exact ceil of |x| to a power of two, biased exponent clamped to [1, 254].

    x: any shape, float -> fp32 of the same shape, every element `2**e` with e in [-126, 127].
    (exponent field + 1 whenever the mantissa is non-zero; zero/denormals map to 2**-126.)
    """
    b = x.abs().float().contiguous().view(torch.int32)
    e = ((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0).to(torch.int32)
    return (e.clamp(1, 254) << 23).view(torch.float32)


def fp32_pow2_to_e8m0_bytes(s: torch.Tensor) -> torch.Tensor:
    """Lossless fp32 -> E8M0 byte conversion (`byte = exponent field`), fp32 `[...]` -> uint8 `[...]`.

    Refuses (ValueError) unless every scale is a positive normal power of two.
    """
    b = s.float().contiguous().view(torch.int32)
    e = (b >> 23) & 0xFF
    if bool(((b < 0) | ((b & 0x7FFFFF) != 0) | (e == 0) | (e == 255)).any()):
        raise ValueError("scales are not all positive normal powers of two; cannot convert to e8m0 losslessly")
    return e.to(torch.uint8)


# --------------------------------------------------------------------------------------------
# Scale broadcasting and dequant
# --------------------------------------------------------------------------------------------

def expand_block_scale(s: torch.Tensor, n: int, k: int, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Broadcast block scales to elements.  s `[..., ceil(n/bn), ceil(k/bk)]` -> `[..., n, k]`."""
    bn, bk = block
    return s.repeat_interleave(bn, -2)[..., :n, :].repeat_interleave(bk, -1)[..., :k]


def dequant_block_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Blockwise dequant `W = w * scale_inv`.

    w `[..., N, K]` e4m3 (or any float), scale_inv `[..., ceil(N/bn), ceil(K/bk)]` -> `[..., N, K]` dtype
    (math in fp32). Leading dims (e.g. experts `[E, N, K]`) broadcast.
    """
    n, k = w.shape[-2:]
    s = expand_block_scale(scale_inv.to(torch.float32), n, k, block)
    return (w.to(torch.float32) * s).to(dtype)


def dequant_per_token_group(q: torch.Tensor, s: torch.Tensor, group_size: int = 128,
                            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `per_token_group_quant_fp8`.  q `[..., K]`, s `[..., ceil(K/g)]` -> `[..., K]` dtype."""
    k = q.shape[-1]
    return (q.to(torch.float32) * s.to(torch.float32).repeat_interleave(group_size, -1)[..., :k]).to(dtype)


# --------------------------------------------------------------------------------------------
# Quantizers
# --------------------------------------------------------------------------------------------

def per_token_group_quant_fp8(x: torch.Tensor, group_size: int = 128, *, eps: float = ACT_EPS,
                              ue8m0: bool = False, fp8_dtype: torch.dtype = FP8_DTYPE,
                              fp8_max: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token-group activation quant (aiter `per_1x128`, sglang `per_token_group_quant_8bit`).

    x `[..., K]` -> (q `[..., K]` fp8_dtype, scale `[..., ceil(K/g)]` fp32, row-major logical layout).
    scale = max(amax_group, eps) / fp8_max; with `ue8m0` it is rounded *up* to a power of two
    (so |x / scale| <= fp8_max still holds). q = clamp(x * (1/scale), -fp8_max, fp8_max) (explicit
    clamp: e4m3fnuz casts overflow to NaN). A partial last group is zero-padded for the amax.
    """
    fmax = fp8_max_of(fp8_dtype) if fp8_max is None else float(fp8_max)
    *lead, k = x.shape
    ng = _cdiv(k, group_size)
    xf = x.to(torch.float32).reshape(-1, k)
    if ng * group_size != k:
        xf = torch.nn.functional.pad(xf, (0, ng * group_size - k))
    xg = xf.view(-1, ng, group_size)                                   # [M, G, g]
    s = xg.abs().amax(-1).clamp_min(eps) / fmax                        # [M, G]
    if ue8m0:
        s = ceil_to_ue8m0(s)
    q = (xg * (1.0 / s)[..., None]).clamp(-fmax, fmax).to(fp8_dtype)   # [M, G, g]
    q = q.view(-1, ng * group_size)[:, :k]
    return q.reshape(*lead, k), s.reshape(*lead, ng)


def quant_weight_block(w: torch.Tensor, block: tuple[int, int] = (128, 128), *, ue8m0: bool = False,
                       eps: float = WEIGHT_AMAX_EPS, fp8_dtype: torch.dtype = FP8_DTYPE,
                       fp8_max: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Block weight quant (DeepGEMM `per_block_cast_to_fp8`; with `ue8m0` = `quant_weight_ue8m0` of §2.3).

    w `[..., N, K]` (bf16/fp32) -> (q `[..., N, K]` fp8_dtype, scale_inv `[..., ceil(N/bn), ceil(K/bk)]` fp32).
    scale_inv = max(amax_block, eps) / fp8_max, optionally ceil'd to a power of two (bit-exact
    `ceil_to_ue8m0`); q = clamp(w * (1/scale_inv)). `dequant_block_fp8(q, scale_inv)` recovers w to
    within half an fp8 ulp per element (relative 2**-4 of the element, plus underflow near zero).
    """
    fmax = fp8_max_of(fp8_dtype) if fp8_max is None else float(fp8_max)
    bn, bk = block
    *lead, n, k = w.shape
    gn, gk = _cdiv(n, bn), _cdiv(k, bk)
    wf = w.to(torch.float32).reshape(-1, n, k)
    if gn * bn != n or gk * bk != k:
        wf = torch.nn.functional.pad(wf, (0, gk * bk - k, 0, gn * bn - n))
    v = wf.view(-1, gn, bn, gk, bk)                                     # [B, gn, bn, gk, bk]
    amax = v.abs().amax(dim=(2, 4), keepdim=True).clamp_min(eps)       # [B, gn, 1, gk, 1]
    sf = amax / fmax
    if ue8m0:
        sf = ceil_to_ue8m0(sf)
    q = (v * (1.0 / sf)).clamp(-fmax, fmax).to(fp8_dtype)
    q = q.view(-1, gn * bn, gk * bk)[:, :n, :k]
    return q.reshape(*lead, n, k).contiguous(), sf.view(*lead, gn, gk).contiguous()


def quant_weight_ue8m0(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """`quant_weight_ue8m0(w, [128,128])` of origin PR B: block e4m3 quant with power-of-two scales."""
    return quant_weight_block(w, tuple(block), ue8m0=True)


def normalize_e4m3fn_to_e4m3fnuz(w: torch.Tensor, scale_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gfx942 only: reinterpret e4m3fn bits as e4m3fnuz (value halves) and double the scale.

    The fn bit pattern 0x80 (-0) is NaN in fnuz, so it is mapped to 0 first.
    """
    b = w.view(torch.int8).clone()
    b[b == -128] = 0
    return b.view(FP8_FNUZ_DTYPE), scale_inv * 2.0


# --------------------------------------------------------------------------------------------
# GEMM references
# --------------------------------------------------------------------------------------------

def w8a8_block_fp8_matmul(x_q: torch.Tensor, x_s: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor,
                          block: tuple[int, int] = (128, 128), out_dtype: torch.dtype = torch.bfloat16,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 block GEMM on pre-quantized operands (what `gemm_a8w8_blockscale` computes).

    x_q `[M, K]` fp8, x_s `[M, ceil(K/bk)]` fp32 (1 x bk groups; row-major logical), w `[N, K]` fp8,
    scale_inv `[ceil(N/bn), ceil(K/bk)]` -> y `[M, N]` out_dtype.  y = dq(x) @ dq(W)^T (+ bias), fp32.
    """
    x = dequant_per_token_group(x_q, x_s, block[1])
    y = x @ dequant_block_fp8(w, scale_inv, block).T
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(out_dtype)


def w8a8_block_fp8_matmul_kblocked(x_q: torch.Tensor, x_s: torch.Tensor, w: torch.Tensor,
                                   scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                                   out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The kernels' accumulation order: for each K block kb,
    `acc += (x_q[:, kb] @ w[:, kb]^T) * x_s[:, kb, None] * scale_inv[None, n // bn, kb]`.
    Same operands/shapes as `w8a8_block_fp8_matmul`; used to check the two forms agree."""
    bn, bk = block
    m, k = x_q.shape
    n = w.shape[0]
    acc = torch.zeros(m, n, dtype=torch.float32, device=x_q.device)
    ws_rows = scale_inv.to(torch.float32).repeat_interleave(bn, 0)[:n]          # [N, ceil(K/bk)]
    for kb in range(_cdiv(k, bk)):
        sl = slice(kb * bk, min(k, (kb + 1) * bk))
        part = x_q[:, sl].to(torch.float32) @ w[:, sl].to(torch.float32).T      # [M, N]
        acc += part * x_s[:, kb, None].to(torch.float32) * ws_rows[None, :, kb]
    return acc.to(out_dtype)


def block_fp8_linear(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor,
                     block: tuple[int, int] = (128, 128), out_dtype: torch.dtype | None = None, *,
                     mode: str = "w8a8", act_ue8m0: bool = False, bias: torch.Tensor | None = None,
                     fp8_dtype: torch.dtype = FP8_DTYPE, fp8_max: float | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """`y = x @ dequant(W).T` with the numerics of a block-FP8 serving kernel (copied into `out` when given).

    x `[..., K]` (bf16/fp32) or a pre-quantized tuple `(x_q [..., K] fp8, x_s [..., ceil(K/bk)] fp32)`;
    w `[N, K]` e4m3; scale_inv `[ceil(N/bn), ceil(K/bk)]` fp32 -> y `[..., N]` in `out_dtype`
    (default: x.dtype, or bf16 for a pre-quantized tuple, as SGLang's aiter path).

    mode "w8a8" (default): x is quantized per 1 x bk group (dynamic, amax/fp8_max, `act_ue8m0` for
    power-of-two scales), then both operands are dequantized and multiplied in fp32 — what
    aiter/CK/DeepGEMM/Triton block kernels compute up to fp32 summation order.
    mode "w8a16": no activation quant (x used as-is in fp32; the weight-only / upcast path).
    """
    if isinstance(x, (tuple, list)):
        x_q, x_s = x
        lead = x_q.shape[:-1]
        xf = dequant_per_token_group(x_q.reshape(-1, x_q.shape[-1]), x_s.reshape(-1, x_s.shape[-1]), block[1])
        odt = out_dtype or torch.bfloat16
    else:
        lead = x.shape[:-1]
        odt = out_dtype or x.dtype
        x2 = x.reshape(-1, x.shape[-1])
        if mode == "w8a8":
            x_q, x_s = per_token_group_quant_fp8(x2, block[1], ue8m0=act_ue8m0, fp8_dtype=fp8_dtype, fp8_max=fp8_max)
            xf = dequant_per_token_group(x_q, x_s, block[1])
        elif mode == "w8a16":
            xf = x2.to(torch.float32)
        else:
            raise ValueError(f"block_fp8_linear: unknown mode {mode!r} (expected 'w8a8' or 'w8a16')")
    y = xf @ dequant_block_fp8(w, scale_inv, block).T                          # [M, N] fp32
    if bias is not None:
        y = y + bias.to(torch.float32)
    y = y.to(odt).reshape(*lead, w.shape[0])
    return y if out is None else out.copy_(y)
