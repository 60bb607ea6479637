"""Kimi Delta Attention (KDA): the linear-attention mixer of GLM-5.3-Flash (`glm5_next`), on packed
tokens with per-sequence fixed-size state caches.

    q, k, v = SiLU(causal_conv1d(q_proj(x) | k_proj(x) | v_proj(x)))       short conv, K taps, fp32 weights
    g       = lb * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias))           (lower bound lb; else
              -exp(A_log) * softplus(...))                                  per-channel log-decay [T, h, dk]
    beta    = sigmoid(b_proj(x))                                            [T, h]
    o       = KDA(q, k, v, g, beta)  (ops kda_chunked / kda_decode)         [T, h, dv]
    out     = o_proj(RMSNorm(o) * weight * sigmoid(g_b(g_a(x))))            gated RMSNorm per head

State caches (allocated by the model runner, indexed by `AttnGroup.state_slots`):
    conv_state [S, K-1, 3·h·dk] model dtype: the last K-1 inputs of the conv, channels q|k|v
    rec_state  [S, h, dk, dv]   fp32: the delta-rule state
Heads are split across TP ranks (h = H / tp); o_proj all-reduces. Parameter names are the checkpoint's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glm_ray import kernels
from glm_ray.config import ModelConfig
from glm_ray.distributed.parallel_state import tp_rank
from glm_ray.forward_batch import AttnGroup, ForwardBatch
from glm_ray.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from glm_ray.weights import load_sharded, set_weight_attrs


class ShortConv(nn.Module):
    """Depthwise conv weight `[C, 1, K]` as on disk (fp32, kept fp32), sharded by channel (= heads)."""

    def __init__(self, channels: int, kernel: int, tp: int):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(channels // tp, 1, kernel, dtype=torch.float32), requires_grad=False)

    def weight_loader(self, param, ckpt, shard_id=None):
        load_sharded(param, ckpt, shard_dim=0, rank=tp_rank(), tp=self.tp)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm with a sigmoid output gate, fp32 math: w * x/rms(x) * sigmoid(gate)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = set_weight_attrs(nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False),
                                       is_norm=True)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * self.weight.float()
        return (y * torch.sigmoid(gate.float())).to(x.dtype)

    def weight_loader(self, param, ckpt, shard_id=None):
        load_sharded(param, ckpt, shard_dim=None, rank=0, tp=1)


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, *, layer_idx: int, quant_config, prefix: str,
                 params_dtype: torch.dtype, tp: int):
        super().__init__()
        H, dk, D = cfg.linear_num_heads, cfg.linear_head_dim, cfg.hidden_size
        if H % tp:
            raise ValueError(f"linear_num_heads {H} is not divisible by tp={tp}")
        self.h, self.dk, self.dv, self.tp = H // tp, dk, dk, tp
        self.K = cfg.linear_conv_kernel_dim
        self.lower_bound = cfg.linear_lower_bound
        self.layer_idx = layer_idx
        common = dict(quant_config=quant_config, params_dtype=params_dtype)
        def col(i, o, name):
            return ColumnParallelLinear(i, o, prefix=f"{prefix}.{name}", tp=tp, **common)

        def rep(i, o, name):
            return ReplicatedLinear(i, o, prefix=f"{prefix}.{name}", **common)
        self.q_proj, self.k_proj, self.v_proj = (col(D, H * dk, n) for n in ("q_proj", "k_proj", "v_proj"))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (ShortConv(H * dk, self.K, tp) for _ in range(3))
        self.f_a_proj = rep(D, dk, "f_a_proj")
        self.f_b_proj = col(dk, H * dk, "f_b_proj")
        self.dt_bias = self._sharded_fp32(self.h * dk)                        # [h*dk]
        self.A_log = self._sharded_fp32(self.h)                               # [h]
        self.b_proj = col(D, H, "b_proj")
        self.g_a_proj = rep(D, dk, "g_a_proj")
        self.g_b_proj = col(dk, H * dk, "g_b_proj")
        self.o_norm = GatedRMSNorm(dk, cfg.rms_norm_eps, params_dtype)
        self.o_proj = RowParallelLinear(H * dk, D, prefix=f"{prefix}.o_proj", tp=tp, **common)
        self._conv_w: torch.Tensor | None = None                              # [3·h·dk, K] after loading

    def _sharded_fp32(self, n: int) -> nn.Parameter:
        p = nn.Parameter(torch.zeros(n, dtype=torch.float32), requires_grad=False)
        return set_weight_attrs(p, weight_loader=self._load_head_sharded)

    def _load_head_sharded(self, param, ckpt, shard_id=None):
        load_sharded(param, ckpt, shard_dim=0, rank=tp_rank(), tp=self.tp)

    def conv_weight(self) -> torch.Tensor:
        """[3·h·dk, K] fp32, channels q|k|v (the layout of conv_state's last dim); built once after loading."""
        if self._conv_w is None:
            self.process_weights_after_loading()
        return self._conv_w

    def process_weights_after_loading(self) -> None:
        self._conv_w = torch.cat([c.weight[:, 0] for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)])

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> log-decay g [T, h, dk] fp32 (<= 0)."""
        a = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias).view(-1, self.h, self.dk)   # [T, h, dk]
        rate = torch.exp(self.A_log)[:, None]                                 # [h, 1]
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * a)
        return -rate * F.softplus(a, threshold=20.0)

    # ---- forward in three parts: projections | the recurrent core per group | output; a piecewise CUDA
    # graph (worker/piecewise_graph.py) captures the first and the last and runs the core eagerly
    def project(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x [T, D] -> mixed [T, 3·h·dk] (q|k|v before the short conv), g [T, h, dk] fp32 (log-decay),
        beta [T, h] fp32, gate [T, h, dk] (the output norm's gate)."""
        T = x.shape[0]
        return {"mixed": torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1),
                "g": self.forget_gate(x), "beta": torch.sigmoid(self.b_proj(x).float()),
                "gate": self.g_b_proj(self.g_a_proj(x)).view(T, self.h, self.dk)}

    def attend(self, proj: dict[str, torch.Tensor], batch: ForwardBatch, conv_state: torch.Tensor,
               rec_state: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The short conv + delta rule of every group -> o [T, h, dv] (into `out` when given); reads and
        updates the conv_state / rec_state rows in place."""
        mixed = proj["mixed"]
        o = out if out is not None else mixed.new_empty(mixed.shape[0], self.h, self.dv)   # [T, h, dv]
        w = self.conv_weight()                                                # [3·h·dk, K] fp32
        for grp in batch.groups:
            o.index_copy_(0, grp.token_index, self._group(grp, mixed, proj["g"], proj["beta"], w, conv_state,
                                                          rec_state))
        return o

    def finish(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o [T, h, dv], gate [T, h, dk] -> o_proj(o_norm(o, gate)) [T, D]."""
        return self.o_proj(self.o_norm(o, gate).reshape(o.shape[0], self.h * self.dv))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, conv_state: torch.Tensor,
                rec_state: torch.Tensor) -> torch.Tensor:
        """x [T, D] packed tokens -> [T, D]; reads and updates conv_state / rec_state rows in place."""
        proj = self.project(x)
        return self.finish(self.attend(proj, batch, conv_state, rec_state), proj["gate"])

    def _group(self, grp: AttnGroup, mixed, g, beta, w, conv_state, rec_state) -> torch.Tensor:
        """One group on its padded view [B, Qmax]; returns its outputs [Tg, h, dv] in token_index order."""
        if grp.state_slots is None or grp.state_fresh is None:
            raise ValueError("KDA needs AttnGroup.state_slots / state_fresh (build_forward_batch state_slots)")
        B, Q = grp.q_index.shape
        h, dk = self.h, self.dk
        slots, fresh, valid = grp.state_slots, grp.state_fresh, grp.q_valid   # [B], [B], [B, Q]
        ops = kernels.ops()
        # kernel ops against the state caches: read the rows at the slots (zero where fresh), write
        # the new states back in place
        y = ops.causal_conv1d(mixed[grp.q_index], w, valid.sum(1), conv_state, slots, fresh)   # [B, Q, 3·h·dk]
        q, k, v = y.view(B, Q, 3, h, dk).unbind(2)                            # [B, Q, h, dk] each
        keep = valid[..., None, None]                                         # [B, Q, 1, 1]
        k, v = k * keep, v * keep                                             # padding: k = v = 0
        gg = g[grp.q_index] * keep                                            # [B, Q, h, dk], padding 0
        bb = beta[grp.q_index] * valid[..., None]                             # [B, Q, h], padding 0
        if Q == 1:                                                            # decode: one delta-rule step
            out = ops.kda_decode(q[:, 0], k[:, 0], v[:, 0], gg[:, 0], bb[:, 0], rec_state, slots,
                                 fresh)[:, None]                              # [B, 1, h, dv]
        else:                                                                 # prefill: chunked form
            out = ops.kda_chunked(q, k, v, gg, bb, rec_state, slots, fresh)   # [B, Q, h, dv]
        return out.flatten(0, 1)[grp.packed]                                  # [Tg, h, dv]
