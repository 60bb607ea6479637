"""One TP rank's model, KV-cache tensors and per-request state; turns a `SchedulerOutput` into a
forward pass and (on rank 0) sampled tokens.

`execute(step)` = `collect(launch(step))`. `launch`: update request states -> build inputs +
ForwardBatch (or stage a decode CUDA graph) -> model -> logits of the positions that sample (and of
prompt positions that want prompt logprobs) -> sampling launched on rank 0, tokens left on the device.
`collect`: the step's one host sync (the sampled ids), logprob dicts, outputs. Async scheduling calls
them separately, launching step N+1 before collecting step N; a decode token step N is still sampling
arrives as a -1 placeholder and is read from step N's token tensor on the device.

A failure stays with the requests it belongs to: an exception in the forward fails every request of
the step (reported in `ModelRunnerOutput.failed`, the caches and the runner stay usable); one in
sampling is retried row by row so only the rows that raise fail. The engine frees their KV and goes on.

Structured outputs (rank 0): a request with `structured_outputs` gets a `RequestGrammar` when it arrives
(its compile starts on the grammar thread); each step, the sampling rows' bitmask is filled on the host
after the forward is launched (so it overlaps the device's work) and applied in the sampler. The matcher
follows the request's output history (`RequestGrammar.sync`), so it needs that history complete: under
async scheduling a step with constrained rows first collects the previous launch. Penalties read
device-resident histories (worker/penalties.py) and min_tokens the count of tokens launched, so neither
waits for the previous step.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from glm_ray import envs, kernels
from glm_ray.config import EngineConfig, ModelConfig
from glm_ray.distributed.parallel_state import broadcast, collective_timer, tp_rank, tp_size
from glm_ray.engine.contract import ModelRunnerOutput, SchedulerOutput, StepFailure
from glm_ray.engine.outputs import LogprobDict
from glm_ray.engine.sampling_params import SamplingParams
from glm_ray.engine.structured import GrammarRuntime, RequestGrammar, tokenizer_info
from glm_ray.engine.tokenizer import load_tokenizer
from glm_ray.forward_batch import build_forward_batch, contiguous_block_tables
from glm_ray.layers.indexer import Indexer
from glm_ray.staging import stage
from glm_ray.worker import warmup
from glm_ray.worker.cache import allocate_caches, kv_bytes_per_token
from glm_ray.worker.cuda_graph import DecodeGraphs
from glm_ray.worker.faults import FaultInjector, classify
from glm_ray.worker.penalties import PenaltyState
from glm_ray.worker.piecewise_graph import PiecewiseGraphs, supports_pieces
from glm_ray.worker.sampler import (
    SamplingRow,
    copy_to_host,
    gather_logprobs,
    host_logprobs,
    logprob_tensors,
    sample,
    to_device,
    to_logprob_dict,
)
from glm_ray.worker.step_timeline import StepTimeline

logger = logging.getLogger(__name__)


@dataclass
class ReqState:
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    grammar: RequestGrammar | None = None         # rank 0: structured outputs
    num_sampled: int = 0                          # rank 0: tokens sampled so far, collected or not
    _block_arr: np.ndarray | None = None          # int32 copy of block_ids for the graph staging

    def block_array(self) -> np.ndarray:
        """The block table as int32 numpy (rebuilt only after the table changed: once per block)."""
        if self._block_arr is None:
            self._block_arr = np.asarray(self.block_ids, dtype=np.int32)
        return self._block_arr


@dataclass
class PendingStep:
    """A launched step (rank 0): its sampled tokens still on the device until `ModelRunner.collect`."""
    done: ModelRunnerOutput | None = None          # the finished output (failures, empty steps, collected)
    out: ModelRunnerOutput | None = None           # being filled: prompt logprobs, failed rows
    tokens: torch.Tensor | None = None             # [N] sampled ids of the sampling rows
    raw: torch.Tensor | None = None                # [N, V] raw logprobs
    host: list[torch.Tensor] = field(default_factory=list)   # tokens [N] (+ logprob tensors) on the host
    ready: torch.cuda.Event | None = None          # the host copies' completion (None on the CPU)
    req_ids: list[str] = field(default_factory=list)
    n_logprobs: list[int | None] = field(default_factory=list)
    k: int = 0
    want: bool = False
    t0: float = 0.0
    t1: float = 0.0
    t2: float = 0.0
    marks: tuple | None = None                     # StepTimeline (start, end) of the step's device work


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, model: torch.nn.Module, device: torch.device,
                 num_blocks: int):
        self.cfg, self.model_cfg, self.model, self.device = cfg, model_cfg, model, device
        self.block_size = cfg.cache.block_size
        self.num_slots = num_blocks * self.block_size                           # KV token slots
        # CUDA graphs pad their batches with rows that write one scratch block / state row: one more each
        use_graphs = graphs_enabled(cfg, device)
        piece_tokens = piecewise_max_tokens(cfg, model, device)
        scratch = 1 if (use_graphs or piece_tokens) else 0
        self.kv_caches, self.index_caches, self.state_caches = allocate_caches(
            model_cfg, (num_blocks + scratch) * self.block_size, cfg.scheduler.max_num_seqs + scratch,
            cfg.parallel.tensor_parallel_size, device)
        self.requests: dict[str, ReqState] = {}
        # short prefill chunks over a cached context attend in the absorbed form (forward_batch._attention_units);
        # not with recurrent states (per sequence, not per row) nor a pooled-key indexer (GLM-5.3-Flash)
        absorb = envs.ABSORB_PREFILL_TOKENS.get()
        self.absorb_tokens = 0 if (self.state_caches or model_cfg.index_kpool) else (
            kernels.ops().absorb_prefill_tokens if absorb is None else absorb)
        self.eos = model_cfg.eos_token_ids
        self.faults = FaultInjector.from_env()                                 # None outside reliability tests
        # device marks: measurement (GLM_RAY_STEP_TIMELINE), and the served loop's pacer on a GPU
        # (GLM_RAY_LATE_SCHEDULING: each step's device time, engine/pacing.py)
        marks = envs.STEP_TIMELINE.get() or (envs.LATE_SCHEDULING.get() != "off" and device.type == "cuda")
        self.timeline = StepTimeline(device) if marks else None
        logger.info("KV cache: %d blocks x %d tokens (%.1f MiB per rank)", num_blocks, self.block_size,
                    num_blocks * self.block_size * kv_bytes_per_token(model_cfg, model_cfg.dtype) / 2**20)
        if warmup.enabled(device):                  # eager paths' kernels compile now, not in a user's step
            try:
                warmup.warm_up(self, num_blocks, graph_max_context(cfg, model_cfg, num_blocks * self.block_size))
            except Exception:  # noqa: BLE001 - an optimization: serve without it rather than not at all
                logger.exception("kernel warm-up failed; the first requests compile what they need")
        self.graphs: DecodeGraphs | None = self._capture_graphs(num_blocks) if use_graphs else None
        self.pieces: PiecewiseGraphs | None = self._capture_pieces(num_blocks, piece_tokens) if piece_tokens else None
        self.num_graph_steps = 0                                                # decode steps replayed
        self.num_piecewise_steps = 0                                            # prefill / mixed steps replayed
        # async scheduling: the last launch's sampled tokens (device) and rows, and the launch not collected
        self._last_tokens: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}
        self._pending: PendingStep | None = None
        self.grammars: GrammarRuntime | None = None   # structured outputs, made at the first such request
        self.penalties: PenaltyState | None = None    # penalized requests' histories, made at the first one

    def _capture_graphs(self, num_blocks: int) -> DecodeGraphs | None:
        """Decode CUDA graphs (worker/cuda_graph.py); on any capture failure, eager with an error log."""
        cfg, bs = self.cfg, self.block_size
        max_ctx = graph_max_context(cfg, self.model_cfg, num_blocks * bs)
        topks = [m.topk for m in self.model.modules() if isinstance(m, Indexer)]   # the DSA indexers
        graphs = DecodeGraphs(self.model, self.kv_caches, self.index_caches, self.state_caches,
                              max_num_seqs=cfg.scheduler.max_num_seqs, max_blocks=-(-max_ctx // bs), block_size=bs,
                              pad_block=num_blocks, pad_state_slot=cfg.scheduler.max_num_seqs,
                              dense_threshold=min(topks) if topks else None, device=self.device)
        if self.device.type != "cuda":          # tests: the static-buffer path without capture
            return graphs
        try:
            graphs.capture()
        except Exception:  # noqa: BLE001 - graphs are an optimization: serve eagerly rather than not at all
            logger.exception("CUDA graph capture failed; decode runs eagerly (--enforce-eager silences this)")
            torch.cuda.synchronize(self.device)
            return None
        return graphs

    def _capture_pieces(self, num_blocks: int, max_tokens: int) -> PiecewiseGraphs | None:
        """Piecewise prefill graphs (worker/piecewise_graph.py), in the decode graphs' pool; on any capture
        failure, eager prefill with an error log."""
        extra = [self.cfg.fp8_proj_min_tokens] if self.cfg.fp8_proj_gemm else []   # the FP8-projection switch
        pieces = PiecewiseGraphs(self.model, self.kv_caches, self.index_caches, self.state_caches, max_tokens=max_tokens,
                                 pad_slot=num_blocks * self.block_size, device=self.device, extra_boundaries=extra)
        if self.device.type != "cuda":          # tests: the static-buffer path without capture
            return pieces
        try:
            pieces.capture(self.graphs.pool if self.graphs is not None else None)
        except Exception:  # noqa: BLE001 - graphs are an optimization: serve eagerly rather than not at all
            logger.exception("piecewise CUDA graph capture failed; prefill runs eagerly "
                             "(--piecewise-cuda-graph-max-tokens 0 silences this)")
            torch.cuda.synchronize(self.device)
            return None
        return pieces

    # ---- state diff ---------------------------------------------------------------------------
    def _update_states(self, step: SchedulerOutput) -> None:
        for rid in step.finished_req_ids:
            self.requests.pop(rid, None)
            if self.penalties is not None:
                self.penalties.release(rid)
        for nr in step.new_requests:
            gen = None
            if nr.params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(nr.params.seed)
            st = self.requests[nr.req_id] = ReqState(nr.params, nr.prompt_token_ids, generator=gen)
            if nr.params.structured_outputs is not None and tp_rank() == 0:
                st.grammar = self.grammar_runtime().start(nr.params)
        for s in step.seqs:
            st = self.requests[s.req_id]
            if s.reset_blocks:
                st.block_ids = list(s.block_ids)
            else:
                st.block_ids.extend(s.block_ids)
            if s.reset_blocks or s.block_ids:
                st._block_arr = None

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput | None:
        """One step, synchronously: `collect(launch(step))`."""
        return self.collect(self.launch(step))

    @torch.inference_mode()
    def launch(self, step: SchedulerOutput) -> PendingStep:
        """Run the step's forward and launch its sampling; the host does not wait for the tokens.

        A decode token that is still being sampled by the previous launch (async scheduling) arrives as
        a -1 placeholder and is taken from that launch's token tensor on the device. Rows whose sampling
        needs the host's view of their outputs (structured outputs) first collect the previous launch."""
        t0 = time.perf_counter()
        self._update_states(step)
        if step.is_empty:
            return PendingStep(done=ModelRunnerOutput() if tp_rank() == 0 else None)
        seqs = step.seqs
        try:
            flat = list(itertools.chain.from_iterable(s.token_ids for s in seqs))
            if self.faults is not None:
                self.faults.before_forward(flat)
            patch = self._placeholders(seqs, flat)
            qlens = [len(s.token_ids) for s in seqs]
            tables = [self.requests[s.req_id].block_ids for s in seqs]
            # rows of hidden states to turn into logits: every sampling seq's last token, plus the
            # prompt positions of seqs that want prompt logprobs
            ends = list(itertools.accumulate(qlens))
            sample_rows = [ends[i] - 1 for i, s in enumerate(seqs) if s.sample]
            start = self.timeline.mark() if self.timeline is not None else None
            if self._graph_step(seqs):
                self.num_graph_steps += 1
                t1 = time.perf_counter()
                hidden = self._replay(seqs, flat, tables, patch)                  # [B, D]
            else:
                ids = stage([np.fromiter(flat, dtype=np.int64, count=len(flat))], self.device)[0]   # [T]
                if patch is not None:
                    ids[patch[0]] = patch[1]
                batch = build_forward_batch(qlens, [s.start_pos + len(s.token_ids) for s in seqs], tables,
                                            self.block_size, self.device, self.cfg.mla_mode,
                                            [s.state_slot for s in seqs], self.absorb_tokens)
                t1 = time.perf_counter()
                if self.pieces is not None and self.pieces.fits(len(flat)):
                    self.num_piecewise_steps += 1
                    hidden = self.pieces.run(ids, batch)                                  # [T, D]
                else:
                    hidden = self.model(ids, batch, self.kv_caches, self.index_caches, self.state_caches)   # [T, D]
            logits = self.model.compute_logits(_take_rows(hidden, sample_rows)) if sample_rows else None   # [N, V]
            plp = self._prompt_logprobs(seqs, hidden, ends)
            del hidden
        except Exception as e:  # noqa: BLE001 - the step's requests fail, the runner goes on
            self._last_rows = {}
            done = self._fail_step([s.req_id for s in seqs], e)
            self._share_tokens(step, None, [])                 # the other ranks wait for this step's ids
            return PendingStep(done=done)
        t2 = time.perf_counter()
        if tp_rank() != 0:
            self._share_tokens(step, None, [])
            return PendingStep(done=None)
        pending = PendingStep(out=ModelRunnerOutput(prompt_logprobs=plp), t0=t0, t1=t1, t2=t2)
        sampling = [s.req_id for s in seqs if s.sample]
        self._last_rows = {}
        if sampling:
            states = [self.requests[r] for r in sampling]
            if self._pending is not None and any(st.grammar is not None for st in states):
                self.collect(self._pending)              # the grammars follow the host's output lists
            self._launch_sample(pending, sampling, states, logits)
        if start is not None:
            pending.marks = (start, self.timeline.mark())
        self._share_tokens(step, pending.tokens, pending.req_ids)
        self._pending = pending
        return pending

    def _share_tokens(self, step: SchedulerOutput, tokens: torch.Tensor | None, req_ids: list[str]) -> None:
        """Async scheduling at TP > 1: the next step's decode tokens are placeholders on every rank, so
        rank 0 broadcasts the ids it sampled (`tokens` [K] for `req_ids`, K <= N sampling rows; rows that
        failed send 0) over the TP group, queued on the device like any collective (no host wait), and
        the other ranks keep them as their `_last_tokens`. Every rank calls this for every step it
        launches, on every path, so the collectives pair up."""
        sampling = [s.req_id for s in step.seqs if s.sample]
        if not (step.share_tokens and tp_size() > 1 and sampling):
            return
        if tokens is not None and req_ids == sampling:
            ids = tokens.to(torch.long)                                         # [N]
        else:
            ids = torch.zeros(len(sampling), dtype=torch.long, device=self.device)   # [N]
            if tokens is not None and req_ids:
                row = {r: i for i, r in enumerate(sampling)}
                ids[to_device([row[r] for r in req_ids], self.device, torch.long)] = tokens.to(torch.long)
        broadcast(ids, src=0)
        if tp_rank() != 0:
            self._last_tokens, self._last_rows = ids, {r: i for i, r in enumerate(sampling)}

    def collect(self, pending: PendingStep) -> ModelRunnerOutput | None:
        """Wait for a launched step's tokens (the one host sync of a step) and finish its output."""
        if pending.done is not None or pending.out is None:
            return pending.done
        out = pending.out
        if pending.tokens is not None:
            try:
                if pending.ready is not None:
                    pending.ready.synchronize()                                 # the one host wait per step
                tok_list = pending.host[0].tolist()
                lps = host_logprobs(pending.host[1:]) if pending.want else None
            except Exception as e:  # noqa: BLE001 - an asynchronous failure of the step's sampling
                out.failed.update(self._fail_step(pending.req_ids, e).failed)
            else:
                for i, (rid, tok) in enumerate(zip(pending.req_ids, tok_list)):
                    st = self.requests.get(rid)
                    if st is not None:
                        st.output_ids.append(tok)
                    out.sampled[rid] = tok
                    n = pending.n_logprobs[i]
                    if n is not None:
                        out.logprobs[rid] = to_logprob_dict(tok, lps[0][i], *lps[1][i], n)
        t3 = time.perf_counter()
        out.timings = {"prepare": pending.t1 - pending.t0, "forward": pending.t2 - pending.t1, "sample": t3 - pending.t2}
        if pending.marks is not None:
            out.timings.update(self.timeline.timings(*pending.marks))
        timer = collective_timer()
        if timer is not None:
            out.timings["collectives"] = timer.collect()     # inside "forward" (and the lm_head gather)
        pending.done, pending.out = out, None
        if self._pending is pending:
            self._pending = None
        return out

    def _placeholders(self, seqs, flat: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of T, their token ids on the device) for decode tokens the previous launch is still
        sampling (-1 in token_ids), or None. A placeholder whose request got no token from that launch
        (its step failed: the engine fails the request when it reads that step) computes token 0, and
        its result is discarded."""
        dst, src, row = [], [], 0
        for s in seqs:                                                      # per sequence, not per token
            if s.token_ids[-1] < 0:
                assert len(s.token_ids) == 1, "a placeholder is a decode step's one token"
                flat[row] = 0
                if s.req_id in self._last_rows:
                    dst.append(row)
                    src.append(self._last_rows[s.req_id])
            row += len(s.token_ids)
        if not dst:
            return None
        rows, picks = stage([np.asarray(dst, dtype=np.int64), np.asarray(src, dtype=np.int64)], self.device)   # one copy
        return rows, self._last_tokens[picks]

    def _graph_step(self, seqs) -> bool:
        """A pure-decode step the captured graphs cover (no prompt logprobs, sizes within the buckets)."""
        return (self.graphs is not None and all(len(s.token_ids) == 1 and not s.prompt_logprobs for s in seqs)
                and self.graphs.fits(len(seqs), max(s.start_pos for s in seqs) + 1))

    def _replay(self, seqs, flat: list[int], tables: list[list[int]], patch=None) -> torch.Tensor:
        bs = self.block_size
        pos = [s.start_pos for s in seqs]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, pos)]         # per sequence
        arrays = [self.requests[s.req_id].block_array() for s in seqs]
        return self.graphs.run(flat, pos, slots, arrays, [s.state_slot for s in seqs], patch=patch)

    def _launch_sample(self, pending: PendingStep, req_ids: list[str], states: list[ReqState],
                       logits: torch.Tensor) -> None:
        """Sample every row at once (the tokens stay on the device until `collect`); if that raises,
        row by row, failing only the rows that raise."""
        try:
            tokens, raw = self._sample_rows(req_ids, states, logits)
            ok = list(range(len(req_ids)))
        except Exception:  # noqa: BLE001 - the error path only: find the rows that fail
            ok, toks, raws = [], [], []
            for i, (rid, st) in enumerate(zip(req_ids, states)):    # NOTE: per-row loop on the error path only
                try:
                    t, r = self._sample_rows([rid], [st], logits[i:i + 1])
                except Exception as e:  # noqa: BLE001
                    pending.out.failed.update(self._fail_step([rid], e).failed)
                    continue
                ok.append(i)
                toks.append(t)
                raws.append(r)
            if not ok:
                return
            tokens, raw = torch.cat(toks), torch.cat(raws)
        for i in ok:
            states[i].num_sampled += 1
        pending.tokens, pending.raw = tokens, raw                           # [N], [N, V] on the device
        pending.req_ids = [req_ids[i] for i in ok]
        pending.n_logprobs = [states[i].params.logprobs for i in ok]
        pending.k = max((n or 0) for n in pending.n_logprobs)
        pending.want = any(n is not None for n in pending.n_logprobs)
        # the tokens (and logprobs) start for the host now: a later launch cannot delay reading them
        lp = logprob_tensors(raw, tokens, pending.k) if pending.want else []
        pending.host, pending.ready = copy_to_host([tokens, *lp])
        self._last_tokens, self._last_rows = tokens, {r: i for i, r in enumerate(pending.req_ids)}

    def _sample_rows(self, req_ids: list[str], states: list[ReqState], logits: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.faults is not None:
            self.faults.before_sample([st.prompt_ids for st in states])
        rows = [SamplingRow(st.params, st.generator, st.prompt_ids, st.output_ids, self.eos, st.num_sampled)
                for st in states]
        bitmask = None
        if any(st.grammar is not None for st in states):
            bitmask = self.grammars.bitmask([st.grammar for st in states], [st.output_ids for st in states],
                                            logits.device)
        pen = [i for i, st in enumerate(states) if st.params.needs_penalties]
        penalties = None
        if pen:
            if self.penalties is None:
                self.penalties = PenaltyState(logits.shape[1], logits.device)
            penalties = self.penalties.batch(pen, [req_ids[i] for i in pen], [states[i].params for i in pen],
                                             [(states[i].prompt_ids, states[i].output_ids) for i in pen])
        return sample(logits, rows, bitmask, penalties)

    def grammar_runtime(self) -> GrammarRuntime:
        """Rank 0's structured-output runtime (made once; the tokenizer is read on its compile thread)."""
        if self.grammars is None:
            V, eos, path = self.model_cfg.vocab_size, self.eos, self.cfg.model
            self.grammars = GrammarRuntime(lambda: tokenizer_info(load_tokenizer(path, V), V, eos), V, eos)
        return self.grammars

    def _fail_step(self, req_ids: list[str], e: BaseException) -> ModelRunnerOutput:
        kind = classify(e)
        logger.error("rank %d: step failed (%s) for requests %s", tp_rank(), kind, req_ids, exc_info=e)
        if kind == "oom" and self.device.type == "cuda":
            torch.cuda.empty_cache()                     # give the allocator's cached blocks back
        msg = ("the server ran out of memory while running this request; retry later" if kind == "oom"
               else "an internal error occurred while running this request")
        return ModelRunnerOutput(failed={r: StepFailure(kind, msg) for r in req_ids})

    def _prompt_logprobs(self, seqs, hidden, ends) -> dict[str, list[LogprobDict]]:
        out: dict[str, list[LogprobDict]] = {}
        for i, s in enumerate(seqs):               # per request that asked, not per token
            if not s.prompt_logprobs:
                continue
            st = self.requests[s.req_id]
            P = len(st.prompt_ids)
            start = int(ends[i]) - len(s.token_ids)
            # positions p in this chunk with a known next prompt token p+1 < P
            n = max(0, min(s.start_pos + len(s.token_ids), P - 1) - s.start_pos)
            if n == 0:
                out[s.req_id] = []
                continue
            logits = self.model.compute_logits(hidden[start:start + n])          # [n, V]
            if tp_rank() != 0:
                continue
            lp = torch.log_softmax(logits, -1)
            targets = torch.tensor(st.prompt_ids[s.start_pos + 1:s.start_pos + 1 + n], device=lp.device)
            k = st.params.prompt_logprobs or 0
            chosen, tops = gather_logprobs(lp, targets, k)
            out[s.req_id] = [to_logprob_dict(t, c, *tp, k) for t, c, tp in zip(targets.tolist(), chosen, tops)]
        return out


def graphs_enabled(cfg: EngineConfig, device: torch.device) -> bool:
    """Decode steps replay CUDA graphs (worker/cuda_graph.py) unless --enforce-eager or a forced MLA form."""
    return device.type == "cuda" and not cfg.enforce_eager and cfg.mla_mode == "auto"


def piecewise_max_tokens(cfg: EngineConfig, model: torch.nn.Module, device: torch.device) -> int:
    """The largest prefill / mixed step the piecewise graphs cover; 0 = none (off, not a GPU, forced
    eager or MLA form, or a model whose forward is not split into pieces)."""
    m = cfg.scheduler.max_num_batched_tokens if cfg.piecewise_graph_max_tokens is None else cfg.piecewise_graph_max_tokens
    if not m or not graphs_enabled(cfg, device):
        return 0
    return m if supports_pieces(model) else 0


def graph_max_context(cfg: EngineConfig, model_cfg: ModelConfig, kv_tokens: int) -> int:
    """The longest context a decode graph is captured for (the engine's max_model_len)."""
    return min(model_cfg.max_position_embeddings, kv_tokens, cfg.scheduler.max_model_len or kv_tokens)


def graph_reserve_bytes(cfg: EngineConfig, model_cfg: ModelConfig, model: torch.nn.Module, device: torch.device,
                        max_context: int) -> int:
    """Memory the decode graphs' pool will hold, kept out of the KV budget: the activations of a
    `max_num_seqs`-row decode forward (measured, like the prefill profile) plus the indexer's score rows
    at the largest captured context (B x max_context fp32, with its top-k temporaries: x4)."""
    B = cfg.scheduler.max_num_seqs
    scores = 4 * B * max_context * 4 if model_cfg.has_indexer else 0
    return profile_activation_bytes(cfg, model_cfg, model, device, decode_rows=B) + scores


@torch.inference_mode()
def profile_activation_bytes(cfg: EngineConfig, model_cfg: ModelConfig, model: torch.nn.Module,
                             device: torch.device, decode_rows: int | None = None) -> int:
    """Peak activation memory of the largest step the scheduler can issue (CUDA only).

    Runs one forward of a fresh `max_num_batched_tokens`-token prefill (the largest MoE dispatch, the
    FP8 projection path when on, and the widest padded attention view the bucketing allows) plus the
    logits of `max_num_seqs` rows, on throw-away caches, and returns the peak above what was allocated
    before. The KV cache is then sized from what is left (vLLM's `profile_run` does the same).
    """
    T = cfg.scheduler.max_num_batched_tokens
    if cfg.scheduler.max_model_len:
        T = min(T, cfg.scheduler.max_model_len)
    bs = cfg.cache.block_size
    # NOTE: [T-2, 2] is the widest padded view the prefill bucketing allows for T tokens (two
    # sequences padded to T-2 rows each ~ 2T rows; see forward_batch._partition).
    qlens = [T - 2, 2] if T >= 4 else [T]
    clens = qlens
    if decode_rows is not None:                    # a decode step: one new token at position 1 per row
        T = decode_rows
        qlens, clens = [1] * T, [2] * T
    tables = contiguous_block_tables(clens, bs)
    nblk = sum(map(len, tables))
    kv, idx, states = allocate_caches(model_cfg, nblk * bs, len(qlens), cfg.parallel.tensor_parallel_size, device)
    batch = build_forward_batch(qlens, clens, tables, bs, device, cfg.mla_mode)
    ids = torch.randint(0, model_cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(0)).to(device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    hidden = model(ids, batch, kv, idx, states)                                  # [T, D]
    rows = min(T, cfg.scheduler.max_num_seqs)
    torch.log_softmax(model.compute_logits(hidden[-rows:]).float(), -1)         # sampler-sized logits
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del kv, idx, states, hidden
    torch.cuda.empty_cache()
    return int(peak)


def _take_rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """hidden [T, D] -> hidden[rows] [N, D] with no host sync: a slice when the rows are 0..N-1 (every
    decode step), else a gather by an index copied asynchronously (a list index is a pageable copy,
    which waits for the forward still running on the GPU)."""
    if rows == list(range(len(rows))):
        return hidden[:len(rows)]
    return hidden[to_device(rows, hidden.device, torch.long)]
