"""Serving-benchmark client: drives an OpenAI-compatible server and records per-request timings.

This module owns the load: the workload of each run (built by `datasets`: random ids, ShareGPT, or
generated shared prefixes), the arrival process (all at once, or Poisson) under a max-concurrency
semaphore (or none), warm-up, the concurrency sweep and repetitions, and the HTTP exchange itself
(aiohttp, ``POST {base_url}/v1/completions`` or ``/v1/chat/completions``, streaming or not). It turns
each request into a `metrics.RequestRecord` and each run into a `RunResult`; the definitions of the
metrics live in `metrics.py`, tables/files/plots in `report.py`.

Protocol per request (what sglang.bench_serving and ``vllm bench serve`` send, perf_anchors.md §1):
``prompt`` as a list of token ids, ``max_tokens``, ``ignore_eos: true`` (``--disable-ignore-eos``: false),
``temperature: 0``, ``stream: true`` and ``stream_options.include_usage`` (the final usage chunk gives
the true output length). When the server accepts ``stream_options.continuous_usage_stats`` (vLLM,
SGLang) every chunk carries usage, which gives the exact number of tokens per chunk; otherwise each
chunk with non-empty text counts as one token and `metrics.chunk_token_counts` reconciles with the
total. Without any usage, a request that finished with reason "length" produced exactly ``max_tokens``
tokens; otherwise its output length is the number of text chunks (a lower bound).
The chat API (``--backend openai-chat`` etc.) sends ``messages: [{"role": "user", "content": text}]``:
ShareGPT's text, or the prompt ids detokenized; the input length is then the server's
``usage.prompt_tokens`` (the chat template adds tokens). Without streaming (``--disable-stream``) the
whole answer is one "chunk": TTFT = E2EL and there is no ITL, as in sglang.
Text is turned into ids (ShareGPT) and back (chat) by the server's ``/tokenize`` and ``/detokenize``
(`ServerCodec`; vLLM has both) or a local tokenizer (``--tokenizer``: `datasets.LocalCodec`).
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import aiohttp
import numpy as np
from tqdm.auto import tqdm

from glm_ray.bench import datasets as D
from glm_ray.bench.datasets import DatasetRow, random_prompts, sample_lengths  # noqa: F401 - re-exported
from glm_ray.bench.metrics import RequestRecord, RunSummary, summarize

DEFAULT_VOCAB_SIZE = 1024      # safe for the tiny CPU models; pass --vocab-size for real ones
MAX_ERROR_CHARS = 500
CODEC_CONCURRENCY = 16         # /tokenize and /detokenize calls in flight while building a workload


class BenchError(RuntimeError):
    """A problem that ends the benchmark (server unreachable, bad model, every warm-up failed)."""


@dataclass
class BenchConfig:
    """Everything that defines a benchmark sweep."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None               # None: the first id of GET /v1/models
    endpoint: str = "/v1/completions"
    api: str = "completions"               # "completions" (prompt ids) | "chat" (messages)
    backend: str = "sglang-oai"            # the --backend name, reported as sglang does
    stream: bool = True                    # False: one JSON answer per request (--disable-stream)
    ignore_eos: bool = True                # False: --disable-ignore-eos
    dataset: str = "random"                # datasets.DATASETS
    dataset_path: str | None = None        # sharegpt: the JSON file
    tokenizer: str | None = None           # a local tokenizer dir; None: the server's /tokenize, /detokenize
    sharegpt_output_len: int | None = None
    sharegpt_context_len: int | None = None
    gsp_num_groups: int = 64
    gsp_prompts_per_group: int = 16
    gsp_system_prompt_len: int = 2048
    gsp_question_len: int = 128
    gsp_output_len: int = 256
    gsp_range_ratio: float = 1.0
    input_len: int = 1024                  # random: --random-input-len
    output_len: int = 1024                 # random: --random-output-len
    range_ratio: float = 1.0               # sglang law: lengths ~ U[max(int(L*r), 1), L]; 1.0 = fixed
    random_prefix_len: int = 0             # vLLM: shared random prefix before every random prompt
    concurrencies: Sequence[int | None] = (4, 8, 16, 32, 64)   # None: no limit (sglang: "not set")
    prompts_per_concurrency: int = 4       # num_prompts = this * C, unless num_prompts is set
    num_prompts: int | None = None
    request_rate: float = math.inf         # requests/s; inf = all at once; finite = Poisson arrivals
    warmup_requests: int = 1
    warmup_output_len: int = 32
    warmup_pause_s: float = 1.0
    repetitions: int = 1
    seed: int = 42
    vocab_size: int | None = None          # None: server's advertised vocab_size, else DEFAULT_VOCAB_SIZE
    exclude_token_ids: Sequence[int] = ()
    label: str = ""
    request_timeout_s: float = 600.0       # longest silence allowed on one stream
    usage_per_chunk: str = "auto"          # auto | on | off (stream_options.continuous_usage_stats)
    extra_body: dict[str, Any] = field(default_factory=dict)
    tolerance: float = 0.05                # relative tolerance of the consistency checks
    show_progress: bool = True

    def prompts_for(self, concurrency: int | None) -> int:
        if self.dataset == "generated-shared-prefix":
            return self.gsp_num_groups * self.gsp_prompts_per_group        # sglang: --num-prompts unused
        if self.num_prompts is not None:
            return self.num_prompts
        if concurrency is None:
            raise BenchError("num_prompts is needed when the concurrency is not limited")
        return self.prompts_per_concurrency * concurrency

    def check(self) -> None:
        """Raise `BenchError` for a configuration that cannot run."""
        if self.dataset not in D.DATASETS:
            raise BenchError(f"unknown dataset {self.dataset!r} (one of {', '.join(D.DATASETS)})")
        if self.api not in ("completions", "chat"):
            raise BenchError(f"unknown api {self.api!r}")
        if self.dataset == "sharegpt" and not self.dataset_path:
            raise BenchError("--dataset-name sharegpt needs --dataset-path (a ShareGPT JSON file; nothing is "
                             "downloaded)")
        if not 0.0 <= self.range_ratio <= 1.0 or not 0.0 <= self.gsp_range_ratio <= 1.0:
            raise BenchError("range ratios must be in [0, 1] (sglang's law)")
        if self.dataset != "generated-shared-prefix" and self.num_prompts is None and None in self.concurrencies:
            raise BenchError("--num-prompts is needed when --max-concurrency is not set")


@dataclass
class ServerInfo:
    """What the readiness probe learned about the server (and, for ShareGPT, the usable rows found)."""

    model: str
    vocab_size: int
    vocab_source: str                      # "--vocab-size", "server", "default"
    usage_per_chunk: bool
    dataset_rows: int | None = None        # sharegpt: usable (prompt, completion) pairs kept


@dataclass
class RunResult:
    """One run: a concurrency level and a repetition index."""

    concurrency: int | None                # None: no limit
    repetition: int
    num_prompts: int
    t0: float                              # run start on the records' clock
    duration_s: float
    records: list[RequestRecord]
    summary: RunSummary


class ServerCodec:
    """Text <-> ids through the server's ``POST /tokenize`` and ``/detokenize`` (vLLM's and ours)."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str):
        self.session, self.base, self.model = session, base_url.rstrip("/"), model
        self._sem = asyncio.Semaphore(CODEC_CONCURRENCY)

    async def _post(self, path: str, body: dict) -> dict:
        async with self._sem:
            try:
                async with self.session.post(self.base + path, json=body) as resp:
                    text = await resp.text(errors="replace")
                    if resp.status != 200:
                        raise BenchError(f"POST {self.base}{path} gave HTTP {resp.status}: {_short(text)} "
                                         "(pass --tokenizer DIR to use a local tokenizer)")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                raise BenchError(f"POST {self.base}{path} failed: {type(e).__name__}: {e}") from None
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise BenchError(f"POST {self.base}{path}: not JSON: {_short(text)}") from None

    async def encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        outs = await asyncio.gather(*(self._post("/tokenize", {"model": self.model, "prompt": t,
                                                               "add_special_tokens": add_special_tokens})
                                      for t in texts))
        return [list(o.get("tokens") or []) for o in outs]

    async def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        outs = await asyncio.gather(*(self._post("/detokenize", {"model": self.model, "tokens": list(x)})
                                      for x in ids))
        return [str(o.get("prompt", "")) for o in outs]


# ----------------------------------------------------------------------------------------------
# HTTP

def _read_prompt_usage(rec: RequestRecord, usage: dict) -> None:
    """The server's prompt count and its prefix-cache hits (usage.prompt_tokens_details.cached_tokens)."""
    if usage.get("prompt_tokens") is not None:
        rec.server_prompt_tokens = int(usage["prompt_tokens"])
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        rec.cached_tokens = int(details["cached_tokens"])


def _payload(cfg: BenchConfig, model: str, prompt: list[int] | str, max_tokens: int,
             usage_per_chunk: bool) -> dict:
    body: dict[str, Any] = {"model": model}
    if cfg.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body.update({"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": cfg.ignore_eos, "stream": cfg.stream})
    if cfg.stream:
        body["stream_options"] = {"include_usage": True}
        if usage_per_chunk:
            body["stream_options"]["continuous_usage_stats"] = True
    body.update(cfg.extra_body)
    return body


def _choice_text(ch: dict) -> str:
    """Generated text of one choice: completions ``text``, chat ``delta``/``message`` content
    (reasoning text counts: it is generated tokens too)."""
    if ch.get("text"):
        return str(ch["text"])
    d = ch.get("delta") or ch.get("message") or {}
    return str(d.get("content") or d.get("reasoning_content") or "")


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."


async def send_request(
    session: aiohttp.ClientSession, url: str, payload: dict, rec: RequestRecord
) -> RequestRecord:
    """POST one streaming completion and fill ``rec`` with what arrived when."""
    seen_usage_tokens = 0
    finished = False
    rec.start = time.perf_counter()
    try:
        async with session.post(url, json=payload) as resp:
            rec.http_status = resp.status
            if resp.status != 200:
                rec.end = time.perf_counter()
                rec.error = f"HTTP {resp.status}: {_short(await resp.text(errors='replace'))}"
                return rec
            if "text/event-stream" not in resp.headers.get("Content-Type", ""):
                return _whole_answer(rec, await resp.read())
            buf = b""
            done = False
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                buf += data
                while b"\n" in buf and not done:
                    raw, buf = buf.split(b"\n", 1)
                    line = raw.strip()
                    if not line or line.startswith(b":"):
                        continue
                    rec.end = now
                    if not line.startswith(b"data:"):
                        continue
                    body = line[5:].strip()
                    if body == b"[DONE]":
                        done = True
                        break
                    try:
                        obj = json.loads(body)
                    except json.JSONDecodeError:
                        rec.error = f"bad SSE data: {_short(body.decode(errors='replace'))}"
                        return rec
                    if not isinstance(obj, dict):
                        rec.error = f"bad SSE data: {_short(body.decode(errors='replace'))}"
                        return rec
                    if obj.get("error"):
                        rec.error = f"stream error: {_short(json.dumps(obj['error']))}"
                        return rec
                    choices = obj.get("choices") or []
                    usage = obj.get("usage") or None
                    n_new: int | None = None
                    if usage and usage.get("completion_tokens") is not None:
                        ct = int(usage["completion_tokens"])
                        if choices:             # continuous usage: this chunk's own count
                            n_new = ct - seen_usage_tokens
                            seen_usage_tokens = ct
                            rec.tokens_from_usage = True
                        rec.output_len = ct
                        rec.output_len_source = "usage"
                        _read_prompt_usage(rec, usage)
                    if choices:
                        ch = choices[0]
                        if n_new is None:
                            n_new = 1 if _choice_text(ch) else 0
                        if ch.get("finish_reason"):
                            finished = True
                            rec.finish_reason = str(ch["finish_reason"])
                        if n_new > 0:
                            rec.chunk_times.append(now)
                            rec.chunk_tokens.append(n_new)
                if done:
                    break
    except asyncio.TimeoutError:
        rec.end = time.perf_counter()
        rec.error = f"timeout: no data for the read timeout after {len(rec.chunk_times)} chunks"
        return rec
    except (aiohttp.ClientError, OSError) as e:
        rec.end = time.perf_counter()
        rec.error = f"{type(e).__name__}: {_short(str(e))}"
        return rec
    except (ValueError, TypeError, KeyError) as e:      # malformed fields in an otherwise valid chunk
        rec.end = time.perf_counter()
        rec.error = f"bad response: {type(e).__name__}: {_short(str(e))}"
        return rec
    if rec.end is None:
        rec.end = time.perf_counter()
    if rec.output_len is None and rec.finish_reason == "length":
        # no usage from the server, but it stopped at the length limit: exactly max_tokens tokens
        rec.output_len = rec.max_tokens
        rec.output_len_source = "finish_reason=length"
    if not done and not finished:
        rec.error = f"stream ended early after {len(rec.chunk_times)} token chunks (no [DONE])"
    elif not rec.chunk_times and rec.max_tokens > 0:
        rec.error = "stream carried no tokens"
    else:
        rec.success = True
    return rec


def _whole_answer(rec: RequestRecord, raw: bytes) -> RequestRecord:
    """A non-streamed answer: one "chunk" at its arrival carrying every output token (sglang: TTFT =
    latency, no ITL)."""
    rec.end = time.perf_counter()
    try:
        obj = json.loads(raw)
        ch = (obj.get("choices") or [{}])[0]
        usage = obj.get("usage") or {}
    except (json.JSONDecodeError, AttributeError, IndexError, TypeError):
        rec.error = f"bad response: {_short(raw.decode(errors='replace'))}"
        return rec
    if obj.get("error"):
        rec.error = f"error: {_short(json.dumps(obj['error']))}"
        return rec
    rec.finish_reason = ch.get("finish_reason")
    _read_prompt_usage(rec, usage)
    if usage.get("completion_tokens") is not None:
        rec.output_len, rec.output_len_source = int(usage["completion_tokens"]), "usage"
        n, rec.tokens_from_usage = rec.output_len, True
    else:
        n = 1 if _choice_text(ch) else 0
        if rec.finish_reason == "length":
            rec.output_len, rec.output_len_source = rec.max_tokens, "finish_reason=length"
    if n > 0:
        rec.chunk_times.append(rec.end)
        rec.chunk_tokens.append(n)
        rec.success = True
    elif rec.max_tokens > 0:
        rec.error = "answer carried no tokens"
    else:
        rec.success = True
    return rec


def _session(cfg: BenchConfig) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=cfg.request_timeout_s)
    return aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0), trust_env=False,
    )


async def probe_server(session: aiohttp.ClientSession, cfg: BenchConfig) -> ServerInfo:
    """Check the server answers, resolve the model name and vocab size, and find out whether
    per-chunk usage is supported (one tiny completion). Raises `BenchError` with one clear line."""
    base = cfg.base_url.rstrip("/")
    try:
        async with session.get(f"{base}/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as resp:
            text = await resp.text(errors="replace")
            status = resp.status
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        raise BenchError(f"cannot reach server at {base} ({type(e).__name__}: {e})") from None
    entries: list[dict] = []
    if status == 200:
        try:
            entries = json.loads(text).get("data") or []
        except (json.JSONDecodeError, AttributeError):
            entries = []
    model = cfg.model
    if model is None:
        if not entries:
            raise BenchError(f"GET {base}/v1/models gave HTTP {status} and no model id; pass --model")
        model = str(entries[0].get("id"))
    entry = next((e for e in entries if e.get("id") == model), {})
    if cfg.vocab_size is not None:
        vocab, source = cfg.vocab_size, "--vocab-size"
    elif isinstance(entry.get("vocab_size"), int) and entry["vocab_size"] > 0:
        vocab, source = int(entry["vocab_size"]), "server"
    else:
        vocab, source = DEFAULT_VOCAB_SIZE, "default"

    prompt: list[int] | str = random_prompts(np.random.default_rng([cfg.seed, 0xFEED]), [4], vocab,
                                             cfg.exclude_token_ids)[0]
    if cfg.api == "chat":
        prompt = "Hello"
    url = base + cfg.endpoint
    modes = {"auto": [True, False], "on": [True], "off": [False]}[cfg.usage_per_chunk] if cfg.stream else [False]
    last = None
    for per_chunk in modes:
        rec = RequestRecord(prompt_len=4, max_tokens=2)
        await send_request(session, url, _payload(cfg, model, prompt, 2, per_chunk), rec)
        if rec.success:
            return ServerInfo(model, vocab, source, per_chunk and rec.tokens_from_usage)
        last = rec
        if rec.http_status is None:           # connection-level failure: retrying changes nothing
            break
    raise BenchError(f"readiness request to {url} failed: {last.error}")


# ----------------------------------------------------------------------------------------------
# Runs

class _Workload:
    """What a sweep's runs draw their requests from: the config, the server, a text codec (ShareGPT or
    chat) and ShareGPT's usable rows."""

    def __init__(self, cfg: BenchConfig, server: ServerInfo, codec=None, pool: Sequence[DatasetRow] = ()):
        self.cfg, self.server, self.codec, self.pool = cfg, server, codec, list(pool)

    def _seed(self, concurrency: int | None, repetition: int, *extra: int) -> np.random.Generator:
        return np.random.default_rng([self.cfg.seed, concurrency or 0, repetition, *extra])

    def rows(self, concurrency: int | None, repetition: int) -> tuple[list[DatasetRow], np.random.Generator]:
        """The run's requests, and the generator that goes on to draw its arrival gaps."""
        cfg, vocab, excl = self.cfg, self.server.vocab_size, self.cfg.exclude_token_ids
        rng = self._seed(concurrency, repetition)
        n = cfg.prompts_for(concurrency)
        if cfg.dataset == "sharegpt":
            idx = rng.permutation(len(self.pool))[:n]
            return [self.pool[int(i)] for i in idx], rng
        if cfg.dataset == "generated-shared-prefix":
            return D.shared_prefix_rows(
                rng, num_groups=cfg.gsp_num_groups, prompts_per_group=cfg.gsp_prompts_per_group,
                system_prompt_len=cfg.gsp_system_prompt_len, question_len=cfg.gsp_question_len,
                output_len=cfg.gsp_output_len, vocab_size=vocab, exclude=excl, range_ratio=cfg.gsp_range_ratio), rng
        return D.random_rows(rng, n, input_len=cfg.input_len, output_len=cfg.output_len, range_ratio=cfg.range_ratio,
                             vocab_size=vocab, exclude=excl, prefix_len=cfg.random_prefix_len), rng

    def warmup_rows(self, concurrency: int | None, repetition: int, prompt_len: int, output_len: int):
        """Fresh random prompts as long as the run's first (no server cache can favour a real request)."""
        rng = self._seed(concurrency, repetition, 1)
        return [DatasetRow(tuple(p), output_len) for p in
                random_prompts(rng, [prompt_len] * self.cfg.warmup_requests, self.server.vocab_size,
                               self.cfg.exclude_token_ids)]

    async def prompts(self, rows: Sequence[DatasetRow]) -> list[list[int] | str]:
        """What each request sends: the ids (completions) or text (chat; ids detokenized when the
        dataset has no text)."""
        if self.cfg.api != "chat":
            return [list(r.prompt_ids) for r in rows]
        todo = [i for i, r in enumerate(rows) if r.text is None]
        texts = await self.codec.decode([rows[i].prompt_ids for i in todo]) if todo else []
        out: list[list[int] | str] = [r.text or "" for r in rows]
        for i, t in zip(todo, texts):
            out[i] = t
        return out


async def _send_all(session, cfg: BenchConfig, server: ServerInfo, sem: asyncio.Semaphore | None,
                    rows: Sequence[DatasetRow], prompts: Sequence[list[int] | str], gaps: Sequence[float],
                    pbar=None) -> list[RequestRecord]:
    """One request per row, started ``gaps`` apart, at most ``sem`` at once (None: no limit)."""
    url = cfg.base_url.rstrip("/") + cfg.endpoint

    async def one(i: int) -> RequestRecord:
        rec = RequestRecord(prompt_len=rows[i].prompt_len, max_tokens=rows[i].output_len)
        body = _payload(cfg, server.model, prompts[i], rows[i].output_len, server.usage_per_chunk)
        if sem is None:
            await send_request(session, url, body, rec)
        else:
            async with sem:
                await send_request(session, url, body, rec)
        if cfg.api == "chat" and rec.server_prompt_tokens is not None:
            rec.prompt_len = rec.server_prompt_tokens        # the template's tokens count too
        if pbar is not None:
            pbar.update(1)
        return rec

    tasks = []
    for i in range(len(rows)):
        tasks.append(asyncio.create_task(one(i)))
        if gaps[i] > 0 and i + 1 < len(rows):
            await asyncio.sleep(gaps[i])
    return list(await asyncio.gather(*tasks))


def _conc(c: int | None) -> str:
    return "not set" if c is None else str(c)


async def run_once(
    session: aiohttp.ClientSession, cfg: BenchConfig, server: ServerInfo, concurrency: int | None,
    repetition: int, workload: _Workload | None = None,
) -> RunResult:
    """Warm up, then send the run's requests under a semaphore of ``concurrency`` (None: no limit)."""
    workload = workload or _Workload(cfg, server)
    rows, rng = workload.rows(concurrency, repetition)
    n = len(rows)
    if n == 0:
        raise BenchError("the dataset gave no requests")
    gaps = (rng.exponential(1.0 / cfg.request_rate, size=n).tolist()
            if not math.isinf(cfg.request_rate) else [0.0] * n)
    sem = asyncio.Semaphore(concurrency) if concurrency is not None else None
    warm = workload.warmup_rows(concurrency, repetition, rows[0].prompt_len,
                                min(cfg.warmup_output_len, rows[0].output_len))
    prompts = await workload.prompts(list(rows) + warm)
    if warm:
        recs = await _send_all(session, cfg, server, sem, warm, prompts[n:], [0.0] * len(warm))
        if not any(r.success for r in recs):
            raise BenchError(f"every warm-up request failed: {recs[0].error}")
        if cfg.warmup_pause_s > 0:
            await asyncio.sleep(cfg.warmup_pause_s)

    pbar = None
    if cfg.show_progress:
        pbar = tqdm(total=n, desc=f"C={_conc(concurrency)} rep {repetition + 1}/{cfg.repetitions}",
                    unit="req", leave=False, dynamic_ncols=True)
    t0 = time.perf_counter()
    try:
        records = await _send_all(session, cfg, server, sem, rows, prompts[:n], gaps, pbar)
    finally:
        if pbar is not None:
            pbar.close()
    duration = time.perf_counter() - t0
    summary = summarize(records, duration_s=duration, t0=t0, max_concurrency=concurrency,
                        request_rate=cfg.request_rate, tolerance=cfg.tolerance)
    return RunResult(concurrency, repetition, n, t0, duration, records, summary)


async def _workload(session, cfg: BenchConfig, server: ServerInfo) -> _Workload:
    """The codec (a local tokenizer, else the server's) when text is involved, and ShareGPT's rows."""
    codec = None
    if cfg.dataset == "sharegpt" or cfg.api == "chat":
        codec = D.LocalCodec(cfg.tokenizer) if cfg.tokenizer else ServerCodec(session, cfg.base_url, server.model)
    pool: list[DatasetRow] = []
    if cfg.dataset == "sharegpt":
        pairs = D.load_sharegpt(cfg.dataset_path)
        want = max(cfg.prompts_for(c) for c in cfg.concurrencies)
        pool = await D.sharegpt_rows(pairs, want, np.random.default_rng([cfg.seed]), codec.encode,
                                     fixed_output_len=cfg.sharegpt_output_len,
                                     context_len=cfg.sharegpt_context_len)
        if not pool:
            raise BenchError(f"{cfg.dataset_path}: no usable conversation (prompt and output >= 2 tokens"
                             + (f", total <= {cfg.sharegpt_context_len}" if cfg.sharegpt_context_len else "") + ")")
        server.dataset_rows = len(pool)
    return _Workload(cfg, server, codec, pool)


async def run_sweep_async(
    cfg: BenchConfig,
    on_start: Callable[[ServerInfo], None] | None = None,
    on_result: Callable[[RunResult, ServerInfo], None] | None = None,
) -> tuple[ServerInfo, list[RunResult]]:
    """Probe the server, build the workload, then run every (concurrency, repetition) in order."""
    cfg.check()
    results: list[RunResult] = []
    async with _session(cfg) as session:
        try:
            server = await probe_server(session, cfg)
            workload = await _workload(session, cfg, server)
            if on_start is not None:
                on_start(server)
            for c in cfg.concurrencies:
                for rep in range(cfg.repetitions):
                    res = await run_once(session, cfg, server, c, rep, workload)
                    results.append(res)
                    if on_result is not None:
                        on_result(res, server)
        except D.DatasetError as e:
            raise BenchError(str(e)) from None
    return server, results


def run_sweep(cfg: BenchConfig, on_start=None, on_result=None) -> tuple[ServerInfo, list[RunResult]]:
    """Synchronous wrapper around `run_sweep_async` (starts its own event loop)."""
    return asyncio.run(run_sweep_async(cfg, on_start, on_result))
