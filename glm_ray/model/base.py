"""What every GLM model class shares: the LM head (bf16 in every GLM checkpoint), logits, the post-load
pass, and the map from runtime parameters to checkpoint tensor names; plus `make_mlp`, the FFN of a
decoder layer. A model class builds its body and defines `forward` (and, where its checkpoint names
differ, `checkpoint_name` / `ignores_checkpoint_tensor`).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from glm_ray.config import ModelConfig
from glm_ray.layers.embedding import ParallelLMHead
from glm_ray.layers.moe import MLP, MoE
from glm_ray.quant import Unquantized
from glm_ray.quant.dispatch import FUSED_LINEARS


def make_mlp(cfg: ModelConfig, sparse: bool, *, quant_config, prefix: str, params_dtype, tp: int) -> nn.Module:
    """The FFN of a decoder layer: routed + shared experts, or a dense (clamped) SwiGLU MLP."""
    if sparse:
        return MoE(cfg, quant_config=quant_config, prefix=prefix, params_dtype=params_dtype, tp=tp)
    return MLP(cfg.hidden_size, cfg.intermediate_size, quant_config=quant_config, prefix=prefix,
               params_dtype=params_dtype, tp=tp, swiglu_limit=cfg.swiglu_limit)


class CausalLM(nn.Module):
    """Base of the served model classes: `forward(ids, batch, kv_caches, index_caches, state_caches)
    -> hidden [T, D]`, `compute_logits(hidden) -> [N, V] fp32`, loading hooks."""

    def __init__(self, cfg: ModelConfig, params_dtype: torch.dtype, tp: int = 1):
        super().__init__()
        self.cfg = cfg
        # NOTE: the LM head stays bf16 (unquantized) in every GLM checkpoint
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, quant_config=Unquantized(),
                                      prefix="lm_head", params_dtype=params_dtype, tp=tp)

    def forward(self, input_ids, batch, kv_caches, index_caches, state_caches=None) -> torch.Tensor:
        raise NotImplementedError

    def piecewise(self) -> nn.Module | None:
        """The module whose forward is split into pieces between attentions (`num_pieces`, `piece`,
        `attend`, `out_key`, `attn_outputs`, `index_queries`; worker/piecewise_graph.py), or None."""
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()                                     # [N, V] fp32

    def process_weights_after_loading(self) -> None:
        for m in self.modules():
            qm = getattr(m, "quant_method", None)
            if qm is not None:
                qm.process_weights_after_loading(m)
        for m in self.modules():        # layers that derive runtime tensors (MLA's W_UK/W_UV, KDA's conv taps)
            if m is not self and callable(getattr(type(m), "process_weights_after_loading", None)):
                m.process_weights_after_loading()

    # ---- checkpoint names ------------------------------------------------------------------
    def ignores_checkpoint_tensor(self, name: str) -> bool:
        """True for a checkpoint tensor this model does not serve (the loader skips it)."""
        return False

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor name as this model's checkpoints spell it (identity by default)."""
        return name

    def checkpoint_params(self) -> dict[str, tuple[nn.Parameter, object, dict]]:
        """Every checkpoint tensor name this model expects -> (param, owner's weight_loader, kwargs)."""
        out: dict[str, tuple] = {}
        for name, p in self.named_parameters():
            loader = getattr(p, "weight_loader", None)
            owner = self.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self
            loader = loader or getattr(owner, "weight_loader", None)
            if loader is None:
                raise RuntimeError(f"parameter {name} has no weight_loader")
            for ckpt_name, kwargs in _checkpoint_names(name, owner):
                out[self.checkpoint_name(ckpt_name)] = (p, loader, kwargs)
        return out


def forward_by_pieces(model: nn.Module, input_ids: torch.Tensor, batch, run_piece, piece, attend) -> torch.Tensor:
    """The forward of a piecewise model (`CausalLM.piecewise()`): piece 0, then per layer its attention and
    the next piece -> the last piece's "hidden" [T, D]. `run_piece(k, carry)`: the piecewise graphs' replay;
    None runs `piece(k, carry, index_queries)` eagerly with this step's variant (`model.index_queries`).
    `attend(i, carry, prev_mask, out)` -> (layer i's attention output, the selections it passes on)."""
    if run_piece is None:
        iq = model.index_queries(batch)
        run_piece = lambda k, carry: piece(k, carry, iq)  # noqa: E731
    carry, mask = run_piece(0, {"ids": input_ids}), None
    for i in range(model.cfg.num_hidden_layers):
        key = model.out_key(i)
        carry[key], mask = attend(i, carry, mask, carry.get(key))
        carry = run_piece(i + 1, carry)
    return carry["hidden"]


_EXPERT_PARAM = re.compile(r"^(.*\.experts)\.(w13|w2)_(\w+)$")


def _checkpoint_names(name: str, owner: nn.Module):
    """Yield (checkpoint tensor name, weight_loader kwargs) for one runtime parameter.

    A param may carry `checkpoint_suffix`: its on-disk last name component when that differs from the
    runtime one (Quark block-FP8 stores the runtime `weight_scale_inv` as `weight_scale`)."""
    disk = getattr(getattr(owner, name.rsplit(".", 1)[-1], None), "checkpoint_suffix", None)
    if disk:
        head, _, tail = name.rpartition(".")
        name = f"{head}.{tail.split('_', 1)[0]}_{disk}" if _EXPERT_PARAM.match(name) else f"{head}.{disk}"
    m = _EXPERT_PARAM.match(name)
    if m:
        base, which, suffix = m.groups()
        for e in range(owner.num_experts):
            if which == "w13":
                yield f"{base}.{e}.gate_proj.{suffix}", {"shard_id": "w1", "expert_id": e}
                yield f"{base}.{e}.up_proj.{suffix}", {"shard_id": "w3", "expert_id": e}
            else:
                yield f"{base}.{e}.down_proj.{suffix}", {"shard_id": "w2", "expert_id": e}
        return
    for fused, parts in FUSED_LINEARS.items():          # gate_up_proj, fused_qkv_a_proj: one tensor per shard
        if fused + "." in name:
            for i, part in enumerate(parts):
                yield name.replace(fused + ".", part + "."), {"shard_id": i}
            return
    yield name, {}
