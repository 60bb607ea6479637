"""Structured outputs: a request's `StructuredOutputsParams` (JSON Schema, any JSON object, regex, choice,
EBNF grammar, structural tag) as a grammar that constrains every sampled token.

Owned here:
  * `check(spec)`: whether a spec can become a grammar, without a tokenizer (the engine's request
    validation: a bad schema is a 400 before anything runs);
  * `GrammarRuntime`: one per sampling rank (rank 0's ModelRunner). Compiles grammars against the model's
    vocabulary on a background thread (a new request's grammar compiles while its prompt is prefilled),
    keeps compiled grammars in an LRU (`GLM_RAY_GRAMMAR_CACHE_MB`), and fills the batch's token bitmask
    (`bitmask` -> `TokenBitmask`: one int32 row of ceil(V/32) words per constrained row, filled together
    by xgrammar's threaded batch matcher, `GLM_RAY_GRAMMAR_THREADS`; unconstrained rows have none);
  * `RequestGrammar`: one request's matcher. It follows the request's output history instead of being
    fed token by token: `sync(output_ids)` accepts what was appended and rolls back what was taken away
    (a preemption that drops tokens, a rejected speculative draft), so its state is always the grammar
    state after exactly those tokens. A token the grammar forbids fails that request (a ValueError in
    its sampling, which the model runner contains to the request);
  * `reasoning_end` (StructuredOutputsParams): an output that opens inside a thinking block (GLM with
    thinking on) is constrained only after the marker that closes it; the thinking is free text;
  * `apply_token_bitmask(logits, mask)`: -inf where a constrained row's bit is 0, batched tensor ops on
    the logits' device (no loop over rows or the vocabulary).

When the grammar is complete, only stop tokens are allowed (the model's EOS ids and the request's
`stop_token_ids`), so a constrained output always ends with a stop token, or by max_tokens
(finish_reason "length", then the text is a prefix of a valid output). JSON is generated compactly
(`", "` and `": "` separators, no free whitespace): a schema of bounded size gives output of bounded
length.

Why xgrammar (0.2.x) and not llguidance or outlines-core: on this machine xgrammar filled the masks of
64 rows of a JSON schema over a ~145k-token synthetic byte-level vocabulary in 0.5 ms per step on one
thread, llguidance 1.9.1 in 13 ms on two (same schema, vocabulary and random walk); xgrammar's
native library links no libtorch (its tensors cross through DLPack), so one wheel serves torch 2.11 on
the GPU machine and 2.13 here; it ships the GLM-4.7/GLM-5 tool-call format ("glm_xml" structural tags,
used by serve/tool_grammar.py); and it is what vLLM and SGLang default to, so GLM users get the JSON
dialect they know. Its bitmask kernels are not used: `apply_token_bitmask` is a few torch ops that run on
any device (no nvcc/Triton JIT at serving time).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch
import xgrammar as xgr

from glm_ray import envs
from glm_ray.engine.sampling_params import SamplingParams, StructuredOutputsParams, invalid
from glm_ray.staging import to_device

logger = logging.getLogger(__name__)

JSON_SEPARATORS = (", ", ": ")          # json.dumps' defaults
# Two gaps of xgrammar 0.2.9's character classes, closed by rewriting a grammar's EBNF (`_sanitized`):
#  * the characters of a JSON string with minLength/maxLength are `[^"\\\r\n]`, which admits raw control
#    characters (JSON forbids them: json.loads fails on the output) and no escapes; they become
#    `[^\0-\x1f"\\]` (no control character, quote or backslash: a subset of what the schema allows);
#  * its UTF-8 decoder takes the 3-byte encodings of UTF-16 surrogates (U+D800-U+DFFF) as characters, which
#    no UTF-8 decoder accepts (the text gets three U+FFFD per one, and a maxLength string grows past its
#    limit); every negated class excludes them, and "any character" becomes "any but a surrogate".
_CLASS_REWRITES = {r'^\"\\\r\n': r'^\0-\x1f\"\\', r'\0-\U0010ffff': r'^'}
_NO_SURROGATES = r"\uD800-\uDFFF"


def _sanitized(g: xgr.Grammar) -> xgr.Grammar:
    """`g` with the character-class rewrites above (string literals left alone)."""
    ebnf = str(g)
    out, i, n, changed = [], 0, len(ebnf), False
    while i < n:
        c = ebnf[i]
        if c in "\"[":
            close = c if c == '"' else "]"
            j = i + 1
            while j < n and ebnf[j] != close:
                j += 2 if ebnf[j] == "\\" else 1
            body = ebnf[i + 1:j]
            if c == "[":
                new = _CLASS_REWRITES.get(body, body)
                if new.startswith("^"):
                    new = "^" + _NO_SURROGATES + new[1:]
                changed |= new != body
                body = new
            out.append(c + body + close)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return xgr.Grammar.from_ebnf("".join(out)) if changed else g


# ---- spec -> grammar ---------------------------------------------------------------------------
def _grammar(kind: str, value: str, reasoning_end: str = "") -> xgr.Grammar:
    """The tokenizer-free grammar of a spec (raises on a bad one); after a reasoning block that
    `reasoning_end` closes (any text without it, the marker, at most two spaces/newlines) if one is given."""
    g = _sanitized(_format_grammar(kind, value))
    if not reasoning_end:
        return g
    think = {"type": "structural_tag", "format": {"type": "tag", "begin": "", "end": reasoning_end,
                                                  "content": {"type": "any_text", "excludes": [reasoning_end]}}}
    return xgr.Grammar.concat(xgr.Grammar.from_structural_tag(json.dumps(think)),
                              xgr.Grammar.from_ebnf('root ::= [ \\n]{0, 2}'), g)


def _format_grammar(kind: str, value: str) -> xgr.Grammar:
    if kind in ("json", "json_object"):
        schema, strict = (value, True) if kind == "json" else ('{"type": "object"}', False)
        return xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=JSON_SEPARATORS,
                                            strict_mode=strict)
    if kind == "regex":
        return xgr.Grammar.from_regex(value)
    if kind == "choice":
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in json.loads(value)))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(value)
    if kind == "structural_tag":
        return xgr.Grammar.from_structural_tag(value)
    raise ValueError(f"unknown structured output kind {kind!r}")


def error_param(kind: str) -> str:
    """The OpenAI request field a spec of this kind comes from (the `param` of its 400)."""
    return "tools" if kind == "structural_tag" else "response_format"


@functools.lru_cache(maxsize=512)
def _problem(kind: str, value: str, reasoning_end: str) -> str | None:
    if kind == "json":
        try:
            schema = json.loads(value)
        except ValueError as e:
            return f"the JSON schema is not valid JSON ({e})"
        if not isinstance(schema, (dict, bool)):
            return f"a JSON schema must be an object or a boolean, got {type(schema).__name__}"
    try:
        _grammar(kind, value, reasoning_end)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/its own types for bad specs
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        return re.sub(r"^(\[[^\]]*\]\s*)?(\S+\.(cc|h):\d+:\s*)?", "", msg)[:500]   # no "[time] file.cc:line:"
    return None


def check(spec: StructuredOutputsParams) -> None:
    """Raise ValueError (with `.param`) if `spec` cannot become a grammar. No tokenizer needed; cached."""
    spec.validate()
    kind = spec.kind
    problem = _problem(*spec.key)
    if problem is not None:
        what = {"json": "the JSON schema", "structural_tag": "the tool-call grammar (structural tag)"}.get(kind, f"the {kind}")
        raise invalid(error_param(kind), f"{what} cannot be enforced: {problem}")


# ---- per request ---------------------------------------------------------------------------------
class RequestGrammar:
    """One request's grammar state, following its output history (`sync`). Used by one thread (the step's)."""

    def __init__(self, compiled: Future, stop_ids: list[int]):
        self._compiled = compiled                    # Future[xgr.CompiledGrammar]
        self.stop_ids = stop_ids
        self._matcher: xgr.GrammarMatcher | None = None
        self._tokens: list[int] = []                 # the history prefix the matcher accepted
        self.num_rollbacks = 0                       # tokens rolled back so far (tests, logs)

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        if self._matcher is None:                    # waits for the compile (started when the request arrived)
            self._matcher = xgr.GrammarMatcher(self._compiled.result(), override_stop_tokens=self.stop_ids)
        return self._matcher

    @property
    def terminated(self) -> bool:
        """A stop token was accepted: the output is complete."""
        return self.matcher.is_terminated()

    def sync(self, output_ids: list[int]) -> None:
        """Bring the matcher to the state after exactly `output_ids`: roll back to the common prefix of
        what it accepted and `output_ids`, then accept the rest. Raises ValueError on a token the grammar
        forbids. Append-only histories (every step) cost O(new tokens): a change is looked for only when
        the history is shorter than what was accepted or its token at that length differs (histories
        grow, or are cut back and regrown)."""
        m, acc = self.matcher, self._tokens
        n = len(acc)
        if n and (len(output_ids) < n or output_ids[n - 1] != acc[-1]):
            k = 0                                    # NOTE: a real rollback, not the per-step path
            lim = min(n, len(output_ids))
            while k < lim and acc[k] == output_ids[k]:
                k += 1
            m.rollback(n - k)
            self.num_rollbacks += n - k
            del acc[k:]
            n = k
        for tok in output_ids[n:]:
            if m.is_terminated():
                if tok in self.stop_ids:             # stop tokens after the end (ignore_eos, a discarded async token)
                    continue
                raise ValueError(f"token {tok} after the end of the requested format")
            if not m.accept_token(tok):
                raise ValueError(f"token {tok} does not match the requested format")
            acc.append(tok)


# ---- per sampling rank ---------------------------------------------------------------------------
@dataclass
class TokenBitmask:
    """The allowed tokens of a batch's constrained rows: `bits` [K, ceil(V/32)] int32 (token v = bit v % 32
    of word v // 32), for batch rows `rows` ([K] int64), or for every row in order when `rows` is None.
    Both on the logits' device."""
    bits: torch.Tensor
    rows: torch.Tensor | None = None


def default_threads() -> int:
    return envs.GRAMMAR_THREADS.get() or max(1, min(8, (os.cpu_count() or 2) // 2))


class GrammarRuntime:
    """Compiles grammars (background thread, LRU cache) and fills batched token bitmasks for one sampling
    rank. `tokenizer_info` is called once, on the compile thread, at the first constrained request."""

    def __init__(self, tokenizer_info: Callable[[], xgr.TokenizerInfo], vocab_size: int, eos_ids,
                 *, threads: int | None = None, cache_bytes: int | None = None):
        self.vocab_size = vocab_size
        self.eos_ids = sorted(set(eos_ids))
        self.words = (vocab_size + 31) // 32
        self._make_info = tokenizer_info
        self._compiler: xgr.GrammarCompiler | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._cache_bytes = 0
        self.cache_limit = cache_bytes if cache_bytes is not None else envs.GRAMMAR_CACHE_MB.get() * 2**20
        self.num_compiles = 0                        # grammars compiled (cache misses)
        self.num_cache_hits = 0
        self._batch = xgr.BatchGrammarMatcher(threads or default_threads())
        self._buffers: list[torch.Tensor | None] = [None, None]     # host bitmasks, used alternately
        self._flip = 0

    # -- compile
    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec` (from the cache when it was compiled before). Thread-safe."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return hit
            if self._compiler is None:
                info = self._make_info()
                self._compiler = xgr.GrammarCompiler(info, max_threads=default_threads(), cache_enabled=False)
            compiler = self._compiler
        compiled = compiler.compile_grammar(_grammar(*key))
        with self._lock:
            self.num_compiles += 1
            if key not in self._cache:
                self._cache[key] = compiled
                self._cache_bytes += compiled.memory_size_bytes
                while self._cache_bytes > self.cache_limit and len(self._cache) > 1:
                    _, old = self._cache.popitem(last=False)
                    self._cache_bytes -= old.memory_size_bytes
        return compiled

    def start(self, params: SamplingParams) -> RequestGrammar:
        """A new request's grammar: its compile starts now, on the compile thread."""
        spec = params.structured_outputs
        stops = sorted(set(self.eos_ids) | set(params.stop_token_ids))
        return RequestGrammar(self._pool.submit(self.compile, spec), stops)

    # -- per step
    def _host_buffer(self, rows: int, device: torch.device) -> torch.Tensor:
        """A host int32 [rows, words] buffer, pinned for CUDA. Two buffers alternate, so the one being
        filled is never the source of a copy still in flight (the previous step's)."""
        self._flip ^= 1
        buf = self._buffers[self._flip]
        if buf is None or buf.shape[0] < rows:
            pin = device.type == "cuda"
            buf = torch.empty((max(rows, 8), self.words), dtype=torch.int32, pin_memory=pin)
            self._buffers[self._flip] = buf
        return buf[:rows]

    def bitmask(self, grammars: list[RequestGrammar | None], histories: list[list[int]],
                device: torch.device) -> TokenBitmask | None:
        """The allowed tokens of a batch's constrained rows (None when no row is): each synced to its
        history, then all filled together (threaded); a completed row (stop token accepted) allows only
        its stop tokens. Raises ValueError if a row's history breaks its grammar (callers retry row by row
        to fail just that request)."""
        idx = [i for i, g in enumerate(grammars) if g is not None]
        if not idx:
            return None
        buf = self._host_buffer(len(idx), device)
        live, live_rows = [], []
        for j, i in enumerate(idx):                    # per constrained request, not per token
            g = grammars[i]
            g.sync(histories[i])
            if g.terminated:
                buf[j].zero_()
                for t in g.stop_ids:
                    buf[j, t // 32] |= _bit(t % 32)
            else:
                live.append(g.matcher)
                live_rows.append(j)
        if live:
            self._batch.batch_fill_next_token_bitmask(live, buf, live_rows)
        rows = None if len(idx) == len(grammars) else to_device(idx, device, torch.long)
        return TokenBitmask(buf if device.type == "cpu" else buf.to(device, non_blocking=True), rows)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _bit(j: int) -> int:
    """int32 value of bit j (bit 31 is the sign bit)."""
    return (1 << j) - (1 << 32 if j == 31 else 0)


@functools.lru_cache(maxsize=8)
def _bit_values(device: torch.device) -> torch.Tensor:
    return torch.tensor([_bit(j) for j in range(32)], dtype=torch.int32, device=device)


def apply_token_bitmask(logits: torch.Tensor, mask: TokenBitmask) -> torch.Tensor:
    """logits [N, V] with -inf at the tokens `mask` does not allow in its rows; a new tensor. Batched
    over rows and the vocabulary."""
    V = logits.shape[1]
    bits = mask.bits
    allowed = ((bits.unsqueeze(-1) & _bit_values(logits.device)) != 0).view(bits.shape[0], -1)[:, :V]
    if mask.rows is None:
        return logits.masked_fill(~allowed, float("-inf"))
    sub = logits.index_select(0, mask.rows).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, mask.rows, sub)


def tokenizer_info(tokenizer, vocab_size: int, eos_ids) -> xgr.TokenizerInfo:
    """xgrammar's view of a Hugging Face tokenizer, sized to the model's vocabulary (the logits' width)."""
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(set(eos_ids)))
