"""What quant methods and kernels need to know about a layer, without importing layers/.

- `LayerKind`: a quantizable layer says what it is (`layer.kind`): a dense linear or a routed-experts
  (MoE) layer. Quant configs pick a method by kind (`layer_kind(layer)`), not by `isinstance`.
- `GateMode` / `MoEContract`: the routed experts' contract (gate/up layout, clamped SwiGLU limit,
  padding), recorded on the experts layer and forwarded to whichever kernel runs it — never inferred
  from a global setting.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class LayerKind(str, enum.Enum):
    LINEAR = "linear"
    MOE = "moe"


def layer_kind(layer) -> LayerKind:
    """The kind a layer declares (`kind` attribute); plain linears need not declare it."""
    return LayerKind(getattr(layer, "kind", LayerKind.LINEAR))


class GateMode(enum.Enum):
    SEPARATED = "separated"      # w13 = [gate rows ; up rows]   (what we store at runtime)
    INTERLEAVED = "interleaved"  # rows alternate gate/up        (converted at load, never stored)


@dataclass(frozen=True)
class MoEContract:
    gate_mode: GateMode = GateMode.SEPARATED
    swiglu_limit: float | None = None      # clamped SwiGLU: silu(min(g, L)) * clamp(u, -L, L)
    hidden_pad: int = 0                    # zero columns appended to D for the kernel's alignment
    intermediate_pad: int = 0              # zero rows appended to each half of I
