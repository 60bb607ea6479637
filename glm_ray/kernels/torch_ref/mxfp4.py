"""OCP MXFP4 references (E2M1 elements, E8M0 scales, 1 x 32 blocks).

MXFP4 as the OCP Microscaling spec and AMD Quark define it:

* E2M1 code -> value (bit 3 = sign): `[0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, -1, -1.5, -2, -3, -4, -6]`.
* Packing along the last dim: element 2j in the **low** nibble, 2j+1 in the high nibble
  (`byte = c[2j+1] << 4 | c[2j]`, codes [1, 2] -> 0x21). Weight `[N, K]` -> packed uint8 `[N, K/2]`.
* E8M0 scale byte b <-> 2**(b - 127); b == 0 decodes to 2**-127, b == 255 to NaN. One scale per 32
  consecutive elements of the last dim: `[N, K/32]` uint8.
* The scale exponent depends on `mode` (aiter `MxScaleRoundMode` / Quark `scale_calculation_mode`):
  "even" (Quark default, aiter Triton `dynamic_mxfp4_quant`), "round_up" (aiter HIP default since
  #3212), "round_down" (OCP spec / torchao FLOOR), "ceil" (torchao CEIL). Element rounding after
  scaling is round-to-nearest-even onto the E2M1 grid with saturation at +-6 (`rounding="rne"`);
  `rounding="half_away"` reproduces older Triton kernels (ties away from zero).

Scales are built with integer bit manipulation, never `.to(torch.float8_e8m0fnu)` (which rounds RNE).
Packed data is plain uint8 (view as `torch.float4_e2m1fn_x2` only at a kernel boundary).
"""
from __future__ import annotations

import torch

MX_BLOCK = 32
E2M1_MAX = 6.0
E8M0_BIAS = 127
# code -> value, code = sign << 3 | magnitude index
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# midpoints between consecutive magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
SCALE_MODES = ("even", "round_up", "round_down", "ceil")
_MODE_ALIASES = {"even_round": "even", "rceil": "round_up", "roundup": "round_up", "floor": "round_down",
                 "rounddown": "round_down"}


def canonical_scale_mode(mode: str) -> str:
    """Normalise a scale-calculation-mode name ("even" | "round_up" | "round_down" | "ceil")."""
    m = _MODE_ALIASES.get(str(mode).lower(), str(mode).lower())
    if m not in SCALE_MODES:
        raise ValueError(f"unknown MX scale calculation mode {mode!r}; expected one of {SCALE_MODES}")
    return m


# --------------------------------------------------------------------------------------------
# E2M1 elements
# --------------------------------------------------------------------------------------------

def e2m1_lut(device=None) -> torch.Tensor:
    """The 16-entry code -> fp32 value table."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def f32_to_e2m1(y: torch.Tensor, rounding: str = "rne") -> torch.Tensor:
    """Encode already-scaled values to E2M1 codes.  y `[...]` float -> codes `[...]` uint8 in [0, 15].

    Magnitude rounds to the nearest grid value {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating at 6.
    rounding "rne": ties go to the even code (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4).
    rounding "half_away": ties go up in magnitude (0.25->.5, 1.25->1.5, 2.5->3, 5->6).
    The sign bit is kept (so -0.1 encodes as 0x8 = -0). NaN encodes as a zero magnitude.
    """
    if rounding not in ("rne", "half_away"):
        raise ValueError(f"unknown E2M1 rounding {rounding!r}")
    a = y.to(torch.float32).abs()
    idx = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for i, mid in enumerate(_E2M1_MIDPOINTS):
        # A tie at midpoint i sits between magnitude codes i and i+1; RNE keeps the even one.
        up = (a >= mid) if (rounding == "half_away" or i % 2 == 1) else (a > mid)
        idx += up.to(torch.uint8)
    return idx | (torch.signbit(y.to(torch.float32)).to(torch.uint8) << 3)


def e2m1_to_f32(codes: torch.Tensor) -> torch.Tensor:
    """Decode E2M1 codes `[...]` (uint8, low 4 bits) -> fp32 `[...]`."""
    return e2m1_lut(codes.device)[(codes & 0xF).long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """codes `[..., K]` uint8 (K even) -> packed `[..., K/2]` uint8, element 2j in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dim {codes.shape[-1]} is odd")
    c = codes.to(torch.uint8) & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """packed `[..., K/2]` uint8 -> codes `[..., K]` uint8 (low nibble first)."""
    p = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
    return torch.stack([p & 0xF, p >> 4], -1).flatten(-2)


# --------------------------------------------------------------------------------------------
# E8M0 scales
# --------------------------------------------------------------------------------------------

def e8m0_to_f32(b: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes `[...]` (uint8) -> fp32 `[...]` = 2**(b-127); 0 -> 2**-127 (denormal), 255 -> NaN."""
    bi = b.view(torch.uint8).to(torch.int32) if b.dtype != torch.uint8 else b.to(torch.int32)
    bits = bi << 23
    bits = torch.where(bi == 0, torch.full_like(bits, 0x00400000), bits)
    bits = torch.where(bi == 255, torch.full_like(bits, 0x7FC00000), bits)
    return bits.view(torch.float32)


def _exp_field(x: torch.Tensor) -> torch.Tensor:
    """Biased exponent field of fp32 x (= floor(log2|x|) + 127 for normal x; 0 for 0/denormals)."""
    return (x.to(torch.float32).contiguous().view(torch.int32) >> 23) & 0xFF


def _ceil_exp_field(x: torch.Tensor) -> torch.Tensor:
    """Biased exponent of the smallest power of two >= x (exponent + 1 when the mantissa is non-zero)."""
    u = x.to(torch.float32).contiguous().view(torch.int32)
    e = (u >> 23) & 0xFF
    return torch.where(((u & 0x7FFFFF) != 0) & (e < 255), e + 1, e)


def mx_scale_exponent(amax: torch.Tensor, mode: str = "even") -> torch.Tensor:
    """E8M0 scale byte for FP4 blocks with block abs-max `amax` (fp32, >= 0).  `[...]` -> uint8 `[...]`.

    round_up:   ceil_pow2(amax / 6)           (aiter RoundUp / NV RCEIL)
    round_down: floor_pow2(amax / 4)          (OCP spec)
    ceil:       ceil_pow2(amax / 4)           (torchao CEIL)
    even:       floor_pow2(round(amax) / 4)   where round() rounds amax's mantissa to 1 bit, ties up
                (add 0x200000 to the bits, keep sign+exponent; Quark `even_round`)
    Result is clamped to [0, 254] (unbiased -127..127).
    """
    mode = canonical_scale_mode(mode)
    a = amax.to(torch.float32)
    if mode == "round_up":
        e = _ceil_exp_field(a / E2M1_MAX)
    elif mode == "round_down":
        e = _exp_field(a / 4.0)
    elif mode == "ceil":
        e = _ceil_exp_field(a / 4.0)
    else:  # even
        bits = a.contiguous().view(torch.int32)
        r = ((bits + 0x200000) & -8388608).view(torch.float32)      # & 0xFF800000
        e = _exp_field(r / 4.0)
    return e.clamp(0, 254).to(torch.uint8)


# --------------------------------------------------------------------------------------------
# Quantize / dequantize
# --------------------------------------------------------------------------------------------

def quant_mxfp4(x: torch.Tensor, mode: str = "even", *, rounding: str = "rne",
                block: int = MX_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 quant of the last dim in 1 x 32 blocks.

    x `[..., K]` (K % 32 == 0) -> (packed `[..., K/2]` uint8, scale `[..., K/32]` uint8 E8M0).
    Element: code = E2M1(x * 2**(127 - b)) with `rounding`, saturating at +-6.
    """
    *lead, k = x.shape
    if k % block:
        raise ValueError(f"quant_mxfp4: last dim {k} is not a multiple of the MX block {block}")
    xb = x.to(torch.float32).reshape(*lead, k // block, block)             # [..., K/32, 32]
    b = mx_scale_exponent(xb.abs().amax(-1), mode)                         # [..., K/32]
    inv = torch.exp2(float(E8M0_BIAS) - b.to(torch.float32))               # exact power of two
    codes = f32_to_e2m1(xb * inv[..., None], rounding).reshape(*lead, k)
    return pack_fp4(codes), b


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                  block: int = MX_BLOCK) -> torch.Tensor:
    """packed `[..., K/2]` uint8, scale `[..., K/32]` uint8 -> `[..., K]` dtype (value * 2**(b-127))."""
    v = e2m1_to_f32(unpack_fp4(packed))                                    # [..., K]
    k = v.shape[-1]
    v = v.reshape(*v.shape[:-1], k // block, block) * e8m0_to_f32(scale)[..., None]
    return v.reshape(*v.shape[:-2], k).to(dtype)


def qdq_mxfp4(x: torch.Tensor, mode: str = "even", *, rounding: str = "rne") -> torch.Tensor:
    """Quantize-dequantize (emulated MXFP4 activation): `[..., K]` -> `[..., K]` fp32."""
    return dequant_mxfp4(*quant_mxfp4(x, mode, rounding=rounding))


def mxfp4_linear(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, *,
                 act_mode: str | None = "even", bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dense MXFP4 reference.  x `[..., K]`, w_packed `[N, K/2]`, w_scale `[N, K/32]` -> `[..., N]`.

    act_mode: MX scale mode for dynamic W4A4 activation qdq; None = W4A16 (x used as-is).
    """
    xf = x.to(torch.float32)
    if act_mode is not None:
        xf = qdq_mxfp4(xf, act_mode)
    y = xf @ dequant_mxfp4(w_packed, w_scale).T
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(out_dtype or x.dtype)
