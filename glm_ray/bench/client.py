"""Serving-benchmark client: drives an OpenAI-compatible server and records per-request timings.

This module owns the load: random token-id prompts, the arrival process (all at once, or Poisson)
under a max-concurrency semaphore, warm-up, the concurrency sweep and repetitions, and the
streaming HTTP exchange itself (aiohttp, ``POST {base_url}/v1/completions`` with ``stream: true``).
It turns each request into a `metrics.RequestRecord` and each run into a `RunResult`; the
definitions of the metrics live in `metrics.py`, tables/files/plots in `report.py`.

Protocol per request (what sglang.bench_serving and ``vllm bench serve`` send, perf_anchors.md §1):
``prompt`` as a list of token ids, ``max_tokens``, ``ignore_eos: true``, ``temperature: 0``,
``stream: true`` and ``stream_options.include_usage`` (the final usage chunk gives the true output
length). When the server accepts ``stream_options.continuous_usage_stats`` (vLLM, SGLang) every
chunk carries usage, which gives the exact number of tokens per chunk; otherwise each chunk with
non-empty text counts as one token and `metrics.chunk_token_counts` reconciles with the total.
Without any usage, a request that finished with reason "length" produced exactly ``max_tokens``
tokens; otherwise its output length is the number of text chunks (a lower bound).
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

from glm_ray.bench.metrics import RequestRecord, RunSummary, summarize

DEFAULT_VOCAB_SIZE = 1024      # safe for the tiny CPU models; pass --vocab-size for real ones
MAX_ERROR_CHARS = 500


class BenchError(RuntimeError):
    """A problem that ends the benchmark (server unreachable, bad model, every warm-up failed)."""


@dataclass
class BenchConfig:
    """Everything that defines a benchmark sweep."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None               # None: the first id of GET /v1/models
    endpoint: str = "/v1/completions"
    input_len: int = 1024
    output_len: int = 1024
    range_ratio: float = 1.0               # sglang law: lengths ~ U[max(int(L*r), 1), L]; 1.0 = fixed
    concurrencies: Sequence[int] = (4, 8, 16, 32, 64)
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

    def prompts_for(self, concurrency: int) -> int:
        return self.num_prompts if self.num_prompts is not None else self.prompts_per_concurrency * concurrency


@dataclass
class ServerInfo:
    """What the readiness probe learned about the server."""

    model: str
    vocab_size: int
    vocab_source: str                      # "--vocab-size", "server", "default"
    usage_per_chunk: bool


@dataclass
class RunResult:
    """One run: a concurrency level and a repetition index."""

    concurrency: int
    repetition: int
    num_prompts: int
    t0: float                              # run start on the records' clock
    duration_s: float
    records: list[RequestRecord]
    summary: RunSummary


# ----------------------------------------------------------------------------------------------
# Prompts

def sample_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> list[int]:
    """sglang's length law: uniform integers in [max(int(L*r), 1), L]; r = 1 gives fixed L."""
    lo = max(int(length * range_ratio), 1)
    if lo >= length:
        return [length] * n
    return [int(x) for x in rng.integers(lo, length + 1, size=n)]


def random_prompts(
    rng: np.random.Generator, lengths: Sequence[int], vocab_size: int, exclude: Sequence[int] = ()
) -> list[list[int]]:
    """Token ids drawn uniformly from [0, vocab_size) minus ``exclude`` (no shared prefixes)."""
    excl = np.asarray(sorted({int(t) for t in exclude if 0 <= int(t) < vocab_size}), dtype=np.int64)
    allowed = vocab_size - excl.size
    if allowed <= 0:
        raise BenchError(f"no token ids left: vocab_size={vocab_size} with {excl.size} excluded")
    out = []
    for n in lengths:
        ids = rng.integers(0, allowed, size=n, dtype=np.int64)
        if excl.size:
            # map [0, allowed) onto the allowed ids: shift by the number of excluded ids <= id
            for e in excl:
                ids = ids + (ids >= e)
        out.append(ids.tolist())
    return out


# ----------------------------------------------------------------------------------------------
# HTTP

def _payload(cfg: BenchConfig, model: str, prompt: list[int], max_tokens: int, usage_per_chunk: bool) -> dict:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if usage_per_chunk:
        body["stream_options"]["continuous_usage_stats"] = True
    body.update(cfg.extra_body)
    return body


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
                        if usage.get("prompt_tokens") is not None:
                            rec.server_prompt_tokens = int(usage["prompt_tokens"])
                    if choices:
                        ch = choices[0]
                        if n_new is None:
                            n_new = 1 if ch.get("text") else 0
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

    prompt = random_prompts(np.random.default_rng([cfg.seed, 0xFEED]), [4], vocab, cfg.exclude_token_ids)[0]
    url = base + cfg.endpoint
    modes = {"auto": [True, False], "on": [True], "off": [False]}[cfg.usage_per_chunk]
    last = None
    for per_chunk in modes:
        rec = RequestRecord(prompt_len=len(prompt), max_tokens=2)
        await send_request(session, url, _payload(cfg, model, prompt, 2, per_chunk), rec)
        if rec.success:
            return ServerInfo(model, vocab, source, per_chunk and rec.tokens_from_usage)
        last = rec
        if rec.http_status is None:           # connection-level failure: retrying changes nothing
            break
    raise BenchError(f"readiness request to {url} failed: {last.error}")


# ----------------------------------------------------------------------------------------------
# Runs

async def _warmup(session, cfg: BenchConfig, server: ServerInfo, sem: asyncio.Semaphore,
                  concurrency: int, repetition: int) -> None:
    n = cfg.warmup_requests
    if n <= 0:
        return
    rng = np.random.default_rng([cfg.seed, concurrency, repetition, 1])
    prompts = random_prompts(rng, [cfg.input_len] * n, server.vocab_size, cfg.exclude_token_ids)
    out = min(cfg.warmup_output_len, cfg.output_len)
    url = cfg.base_url.rstrip("/") + cfg.endpoint

    async def one(p):
        async with sem:
            rec = RequestRecord(prompt_len=len(p), max_tokens=out)
            return await send_request(session, url, _payload(cfg, server.model, p, out, server.usage_per_chunk), rec)

    recs = await asyncio.gather(*(one(p) for p in prompts))
    if not any(r.success for r in recs):
        raise BenchError(f"every warm-up request failed: {recs[0].error}")
    if cfg.warmup_pause_s > 0:
        await asyncio.sleep(cfg.warmup_pause_s)


async def run_once(
    session: aiohttp.ClientSession, cfg: BenchConfig, server: ServerInfo, concurrency: int,
    repetition: int,
) -> RunResult:
    """Warm up, then send ``num_prompts`` requests under a semaphore of ``concurrency``."""
    n = cfg.prompts_for(concurrency)
    rng = np.random.default_rng([cfg.seed, concurrency, repetition])
    in_lens = sample_lengths(rng, n, cfg.input_len, cfg.range_ratio)
    out_lens = sample_lengths(rng, n, cfg.output_len, cfg.range_ratio)
    prompts = random_prompts(rng, in_lens, server.vocab_size, cfg.exclude_token_ids)
    gaps = (rng.exponential(1.0 / cfg.request_rate, size=n).tolist()
            if not math.isinf(cfg.request_rate) else [0.0] * n)
    sem = asyncio.Semaphore(concurrency)
    url = cfg.base_url.rstrip("/") + cfg.endpoint

    await _warmup(session, cfg, server, sem, concurrency, repetition)

    pbar = None
    if cfg.show_progress:
        pbar = tqdm(total=n, desc=f"C={concurrency} rep {repetition + 1}/{cfg.repetitions}",
                    unit="req", leave=False, dynamic_ncols=True)

    async def one(i: int) -> RequestRecord:
        async with sem:
            rec = RequestRecord(prompt_len=in_lens[i], max_tokens=out_lens[i])
            await send_request(session, url, _payload(cfg, server.model, prompts[i], out_lens[i],
                                                      server.usage_per_chunk), rec)
        if pbar is not None:
            pbar.update(1)
        return rec

    t0 = time.perf_counter()
    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(one(i)))
        if gaps[i] > 0 and i + 1 < n:
            await asyncio.sleep(gaps[i])
    try:
        records = list(await asyncio.gather(*tasks))
    finally:
        if pbar is not None:
            pbar.close()
    duration = time.perf_counter() - t0
    summary = summarize(records, duration_s=duration, t0=t0, max_concurrency=concurrency,
                        request_rate=cfg.request_rate, tolerance=cfg.tolerance)
    return RunResult(concurrency, repetition, n, t0, duration, records, summary)


async def run_sweep_async(
    cfg: BenchConfig,
    on_start: Callable[[ServerInfo], None] | None = None,
    on_result: Callable[[RunResult, ServerInfo], None] | None = None,
) -> tuple[ServerInfo, list[RunResult]]:
    """Probe the server, then run every (concurrency, repetition) in order."""
    results: list[RunResult] = []
    async with _session(cfg) as session:
        server = await probe_server(session, cfg)
        if on_start is not None:
            on_start(server)
        for c in cfg.concurrencies:
            for rep in range(cfg.repetitions):
                res = await run_once(session, cfg, server, c, rep)
                results.append(res)
                if on_result is not None:
                    on_result(res, server)
    return server, results


def run_sweep(cfg: BenchConfig, on_start=None, on_result=None) -> tuple[ServerInfo, list[RunResult]]:
    """Synchronous wrapper around `run_sweep_async` (starts its own event loop)."""
    return asyncio.run(run_sweep_async(cfg, on_start, on_result))
