"""Prefill and mixed steps as piecewise CUDA graphs: everything between two attentions is one captured
graph per token-count bucket; the attentions run eagerly between the replays.

An eager prefill step is host-bound: on the H200, a 2,176-token mixed step of glm5-flash-31b spent ~280 ms
launching ~2,300 kernels and ~15,000 aten calls for ~46 ms of device work (docs/measurements/2026-12-02).
Almost all of those launches sit outside attention — the projections with their activation quant, the
norms, the MoE routing, alignment and grouped GEMMs — and none of them depends on how the step's tokens
split into sequences, only on how many there are. So, as vLLM's piecewise CUDA graphs (split at attention)
and sglang's piecewise graph do, a step of T tokens runs at the smallest captured bucket Tp >= T:

    piece 0:   embed, rope, layer 0's norm + q/kv projections + cache writes (+ index keys/queries)
    attention 0 (eager: the step's varlen groups, indexer top-k, MLA prefill/decode kernels)
    piece k:   layer k-1's o_proj + post-norm + MLP/MoE, layer k's norm + projections + cache writes
    ...
    piece L:   layer L-1's o_proj + MLP/MoE, the final norm

The pieces are the model's own (`model.piece(k, carry, ...)`, the same code the eager forward runs);
this module owns the static buffers they read and write — the token ids, positions and KV slots of the
step, and the carry between pieces (residual stream, rope, queries, index queries, attention output) —
and replays piece k's graph where the eager forward would run it (`run_piece`). Rows T..Tp are
padding: token 0 at position 0, writing the scratch KV block (the block the scheduler never hands out,
as the decode graphs' padding rows); their outputs are dropped, and no eager attention reads them.

Each bucket is captured twice for a DSA model: with the indexer's queries (steps where some context
passes index_topk) and without. The query tensors are written straight into their static buffers; the
residual stream is copied into its own once per piece. What differs from eager: size-dependent kernel
choices (the small-M FP8 GEMM, the MoE decode kernels, the FP8-projection threshold, inserted as a
bucket boundary) see Tp instead of T.

GLM-5.3-Flash splits the same way around its mixer cores: a piece carries the mHC streams and
coefficients and the mixer's projections (KDA: q|k|v before the short conv, decay, beta, output gate;
NoPE MLA: queries), and the eager core is KDA's conv + delta rule over the state slots or the MLA
attention.

Not captured: steps above the largest bucket (`EngineConfig.piecewise_graph_max_tokens`, default the
step budget max_num_batched_tokens), `--enforce-eager`, forced MLA forms. On the CPU nothing is captured, but the
tests run the same static-buffer path (`run` without graphs) against the eager forward.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch

from glm_ray.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

_SMALL = (16, 32, 64, 96, 128, 192, 256, 384, 512, 640, 768, 1024, 1280, 1536, 1792, 2048)


def token_buckets(max_tokens: int, extra: Iterable[int] = ()) -> list[int]:
    """The captured step sizes: `_SMALL` up to max_tokens, then every 512, then max_tokens itself; plus
    `extra` boundaries (a size threshold the kernels switch at, so a bucket never straddles it)."""
    out = {b for b in _SMALL if b < max_tokens}
    b = 2560
    while b < max_tokens:
        out.add(b)
        b += 512
    out.add(max_tokens)
    out.update(e for e in extra if 0 < e < max_tokens)
    return sorted(out)


def supports_pieces(model: torch.nn.Module) -> bool:
    """The model's forward is split into `piece`s around its attentions (`CausalLM.piecewise`)."""
    return callable(getattr(model, "piecewise", None)) and model.piecewise() is not None


class PiecewiseGraphs:
    """Static buffers + one captured graph per (bucket, piece); `run` stages a step and runs the model's
    forward with the pieces replayed."""

    def __init__(self, model: torch.nn.Module, kv_caches, index_caches, state_caches=None, *, max_tokens: int,
                 pad_slot: int, device: torch.device, extra_boundaries: Iterable[int] = ()):
        self.model, self.inner = model, model.piecewise()
        self.kv_caches, self.index_caches, self.state_caches = kv_caches, index_caches, state_caches or {}
        self.buckets = token_buckets(max_tokens, extra_boundaries)
        self.device, self.pad_slot = device, pad_slot
        n = self.buckets[-1]
        self.ids = torch.zeros(n, dtype=torch.int64, device=device)             # [N]
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)       # [N]
        self.slot_mapping = torch.full((n,), pad_slot, dtype=torch.int64, device=device)   # [N]
        # key -> [N, ...] static buffer: the attentions' outputs now, the pieces' outputs at their first run
        self.carry: dict[str, torch.Tensor] = {key: torch.zeros(n, *shape, dtype=dt, device=device)
                                               for key, (shape, dt) in self.inner.attn_outputs().items()}
        self.keys: dict[tuple[bool, int], tuple[str, ...]] = {}   # (variant, piece) -> the carry keys it writes
        self.graphs: dict[tuple[int, bool, int], torch.cuda.CUDAGraph] = {}   # (bucket, variant, piece)
        self.pool = None
        self.replay_s = 0.0                                                     # host seconds inside replay()
        self.capture_s = 0.0                                                    # start-up seconds of capture()

    # ---- the pieces over the static buffers -------------------------------------------------------
    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.buckets[-1]

    def bucket(self, num_tokens: int) -> int:
        return next(b for b in self.buckets if b >= num_tokens)

    def variants(self) -> tuple[bool, ...]:
        """Captured per bucket: without and (DSA models) with the indexer's queries — a step computes them
        only when some context passes index_topk, and at 8k tokens they cost ~3 ms a layer."""
        return (False, True) if self.model.cfg.has_indexer else (False,)

    def _graph_batch(self, Tp: int) -> ForwardBatch:
        """What a piece reads of a batch: positions and KV slots (no attention groups)."""
        return ForwardBatch(positions=self.positions[:Tp], slot_mapping=self.slot_mapping[:Tp], groups=(),
                            max_context_len=0)

    def _views(self, keys, rows: int) -> dict[str, torch.Tensor]:
        return {key: self.carry[key][:rows] for key in keys if key in self.carry}

    def _inputs(self, scores: bool, k: int, rows: int) -> dict[str, torch.Tensor]:
        """Piece k's carry: views [:rows] of the static buffers written before it (the ids for piece 0;
        the previous piece's keys and the attention output after)."""
        if k == 0:
            return {"ids": self.ids[:rows]}
        return self._views((*self.keys[(scores, k - 1)], self.inner.out_key(k - 1)), rows)

    def _piece(self, scores: bool, k: int, Tp: int) -> None:
        """Run piece k at bucket Tp on the static buffers (eager or under capture): the queries written
        straight into their buffers, the rest of what it returns copied into theirs."""
        out = self.inner.piece(k, self._inputs(scores, k, Tp), self._graph_batch(Tp), self.kv_caches,
                               self.index_caches, scores, self._views(("q", "iq", "iw"), Tp))
        if (scores, k) not in self.keys:                                        # the first run: shapes
            self.keys[(scores, k)] = tuple(out)
            for key, t in out.items():
                if key not in self.carry:
                    self.carry[key] = torch.zeros(self.buckets[-1], *t.shape[1:], dtype=t.dtype, device=t.device)
        for key, t in out.items():
            dst = self.carry[key][:Tp]
            if t.data_ptr() != dst.data_ptr():                  # (written in place, or rope passed through)
                dst.copy_(t)

    # ---- capture ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Capture every (bucket, piece), largest bucket first, into `pool` (the decode graphs' pool: the
        two never replay at once). Each piece runs once eagerly first (Triton compiles, cuBLAS plans)."""
        t0 = time.perf_counter()
        self._fill_padding(0, self.buckets[-1])
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for Tp in reversed(self.buckets):
            for scores in self.variants():
                for k in range(self.inner.num_pieces):
                    stream.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(stream):
                        self._piece(scores, k, Tp)                              # warm-up
                    torch.cuda.current_stream(self.device).wait_stream(stream)
                    torch.cuda.synchronize(self.device)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=self.pool, stream=stream):
                        self._piece(scores, k, Tp)
                    self.graphs[(Tp, scores, k)] = g
        torch.cuda.synchronize(self.device)
        used = torch.cuda.memory_allocated(self.device) - before
        self.capture_s = time.perf_counter() - t0
        logger.info("CUDA graphs: %d piecewise graphs (%d pieces x %d variants x token buckets %s) captured in "
                    "%.1f s, %.0f MiB", len(self.graphs), self.inner.num_pieces, len(self.variants()), self.buckets,
                    self.capture_s, used / 2**20)

    # ---- a step -----------------------------------------------------------------------------------
    def run(self, ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """One step of T = len(ids) tokens (ids [T] on the device, batch its ForwardBatch) -> hidden [T, D]
        (a view of the static output: valid until the next step)."""
        T = ids.shape[0]
        Tp = self.bucket(T)
        self.ids[:T].copy_(ids)
        self.positions[:T].copy_(batch.positions)
        self.slot_mapping[:T].copy_(batch.slot_mapping)
        if Tp > T:
            self._fill_padding(T, Tp)
        scores = self.inner.index_queries(batch)

        def run_piece(k: int, carry: dict) -> dict:
            g = self.graphs.get((Tp, scores, k))
            if g is None:              # not captured (the CPU tests): the same static-buffer piece, eagerly
                self._piece(scores, k, Tp)
            else:
                t0 = time.perf_counter()
                g.replay()
                self.replay_s += time.perf_counter() - t0
            last = k == self.inner.num_pieces - 1
            return self._views((*self.keys[(scores, k)], *(() if last else (self.inner.out_key(k),))), T)

        return self.model(self.ids[:T], batch, self.kv_caches, self.index_caches, self.state_caches,
                          run_piece=run_piece)

    def _fill_padding(self, t0: int, t1: int) -> None:
        """Rows [t0, t1): token 0 at position 0 into the scratch slot."""
        self.ids[t0:t1].zero_()
        self.positions[t0:t1].zero_()
        self.slot_mapping[t0:t1].fill_(self.pad_slot)
