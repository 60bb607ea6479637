"""Serving-benchmark metrics: per-request timing records in, one run summary out.

This module owns the metric *definitions*. They follow sglang.bench_serving and `vllm bench serve`
(their definitions of TTFT, ITL, TPOT and E2EL), so numbers are comparable with tables made by
those tools:

- TTFT   = arrival of the first chunk that carried an output token - request start.
- E2EL   = arrival of the last SSE line (``data: [DONE]`` included) - request start (sglang).
- TPOT   = (E2EL - TTFT) / (output_len - 1), per request, only when output_len > 1.
- ITL    = sglang-native, per token: each later chunk contributes (t_chunk - t_prev) / n, n times,
           where n is the number of tokens the chunk carried. All requests' values go into one pool.
- ITL per chunk (vLLM / sglang-oai semantics): one (t_chunk - t_prev) per later chunk.
- Throughputs are totals over the run's wall duration: output = sum(output_len) / duration,
  total = (sum(prompt_len) + sum(output_len)) / duration, request = completed / duration.
- achieved_concurrency = sum(E2EL) / duration (sglang's "Concurrency").
- peak_output_throughput = most output tokens in any 1-second bucket since the run started
  (token times reconstructed from chunk times the same way per-token ITL splits them).
- peak_concurrent_requests = the exact maximum number of requests in flight (start..last line).

Latency statistics (mean, median, std, p90, p95, p99, min, max) use numpy with linear
interpolation, like both tools; std is the population std. Only successful requests count.

Everything here is pure: no I/O, no clocks. Times are seconds on one monotonic clock.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

ITL_SEMANTICS = "sglang-native: chunk gap split evenly over the tokens in the chunk"

LATENCY_METRICS = ("ttft", "tpot", "itl", "itl_chunk", "e2el")
STAT_NAMES = ("mean", "median", "std", "p90", "p95", "p99", "min", "max")


@dataclass
class RequestRecord:
    """What the client observed for one request (times in seconds, one monotonic clock)."""

    prompt_len: int                      # tokens we sent
    max_tokens: int                      # requested output length
    start: float = 0.0                   # just before the POST
    end: float | None = None             # arrival of the last SSE line ([DONE] included)
    chunk_times: list[float] = field(default_factory=list)   # chunks that carried >= 1 token
    chunk_tokens: list[int] = field(default_factory=list)    # tokens in each of those chunks
    output_len: int | None = None        # true output length (None: unknown), see output_len_source
    output_len_source: str = ""          # "usage" (server count) | "finish_reason=length" (= max_tokens)
    finish_reason: str | None = None
    server_prompt_tokens: int | None = None
    cached_tokens: int | None = None     # usage.prompt_tokens_details.cached_tokens (prefix-cache hits)
    tokens_from_usage: bool = False      # chunk_tokens came from per-chunk usage (exact counts)
    success: bool = False
    error: str = ""
    http_status: int | None = None

    def to_dict(self, t0: float = 0.0) -> dict[str, Any]:
        """JSON-ready dict with times relative to ``t0`` (normally the run start)."""
        d = asdict(self)
        d["start"] = self.start - t0
        d["end"] = None if self.end is None else self.end - t0
        d["chunk_times"] = [t - t0 for t in self.chunk_times]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RequestRecord":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass
class Stats:
    """Distribution summary of one latency metric, in milliseconds (None when no samples)."""

    count: int = 0
    mean: float | None = None
    median: float | None = None
    std: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    min: float | None = None
    max: float | None = None


@dataclass
class ConsistencyCheck:
    """One cross-check between independently measured quantities of a run."""

    name: str
    formula: str
    observed: float | None
    expected: float | None
    rel_err: float | None
    tolerance: float
    ok: bool | None          # None: not applicable to this run (reason says why)
    reason: str = ""


@dataclass
class RunSummary:
    """All aggregate metrics of one run (one concurrency, one repetition)."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    achieved_concurrency: float
    peak_output_throughput: float
    peak_concurrent_requests: int
    mean_input_len: float | None
    mean_output_len: float | None
    mean_first_chunk_tokens: float | None  # > 1: tokens arrived with the first chunk (no ITL for them)
    output_len_matches_request: bool      # every successful request produced max_tokens tokens
    token_counts_exact: bool              # every request's per-chunk token counts were exact
    latency: dict[str, Stats]
    consistency: list[ConsistencyCheck] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)   # error text -> count
    total_cached_tokens: int | None = None          # prompt tokens the server found in its prefix cache
    prefix_cache_hit_rate: float | None = None      # total_cached_tokens / server-counted prompt tokens

    @property
    def consistent(self) -> bool:
        """False if any applicable consistency check failed."""
        return all(c.ok is not False for c in self.consistency)

    def to_dict(self) -> dict[str, Any]:
        """Flat dict with sglang-style keys (mean_ttft_ms, p99_itl_ms, output_throughput, ...)."""
        d: dict[str, Any] = {}
        for k, v in asdict(self).items():
            if k in ("latency", "consistency"):
                continue
            d[k] = v
        for metric, st in self.latency.items():
            for s in STAT_NAMES:
                d[f"{s}_{metric}_ms"] = getattr(st, s)
        d["consistent"] = self.consistent
        d["consistency"] = [asdict(c) for c in self.consistency]
        return d


# ----------------------------------------------------------------------------------------------
# Per-request quantities

def output_len(rec: RequestRecord) -> int:
    """The request's output length: ``rec.output_len`` when known (server usage, or max_tokens when
    the server sent no usage but finished with reason "length"), else the sum of per-chunk counts."""
    if rec.output_len is not None:
        return rec.output_len
    return sum(rec.chunk_tokens)


def chunk_token_counts(rec: RequestRecord) -> list[int]:
    """Tokens carried by each chunk, reconciled with the server's total.

    Exact when the server reported usage per chunk. Otherwise every text chunk was counted as one
    token; if the server's total says there were more tokens than chunks, the first chunk keeps
    one token and the remaining ``total - 1`` are spread as evenly as possible over the later
    chunks (earlier chunks get the remainder). If the total is smaller than the chunk count, the
    per-chunk counts are kept (the server then sent chunks without tokens; we cannot tell which).
    """
    counts = list(rec.chunk_tokens)
    if not counts or rec.output_len is None or rec.tokens_from_usage:
        return counts
    total = rec.output_len
    if total == sum(counts) or total < len(counts):
        return counts
    if len(counts) == 1:
        return [total]
    rest = total - 1
    q, r = divmod(rest, len(counts) - 1)
    return [1] + [q + (1 if i < r else 0) for i in range(len(counts) - 1)]


def ttft(rec: RequestRecord) -> float | None:
    return rec.chunk_times[0] - rec.start if rec.chunk_times else None


def e2el(rec: RequestRecord) -> float | None:
    return None if rec.end is None else rec.end - rec.start


def tpot(rec: RequestRecord) -> float | None:
    n = output_len(rec)
    t, e = ttft(rec), e2el(rec)
    if n <= 1 or t is None or e is None:
        return None
    return (e - t) / (n - 1)


def itl_per_token(rec: RequestRecord) -> list[float]:
    """sglang-native ITL: each later chunk's gap divided by its token count, repeated that often."""
    counts = chunk_token_counts(rec)
    out: list[float] = []
    for i in range(1, len(rec.chunk_times)):
        gap = rec.chunk_times[i] - rec.chunk_times[i - 1]
        n = max(counts[i], 1)
        out.extend([gap / n] * n)
    return out


def itl_per_chunk(rec: RequestRecord) -> list[float]:
    """vLLM / sglang-oai ITL: one gap per later chunk, whatever it carried."""
    t = rec.chunk_times
    return [t[i] - t[i - 1] for i in range(1, len(t))]


def token_times(rec: RequestRecord) -> list[float]:
    """Reconstructed arrival time of every output token (consistent with per-token ITL)."""
    counts = chunk_token_counts(rec)
    out: list[float] = []
    prev = None
    for t, n in zip(rec.chunk_times, counts):
        if prev is None:
            out.extend([t] * n)
        else:
            step = (t - prev) / max(n, 1)
            out.extend(prev + step * (k + 1) for k in range(n))
        prev = t
    return out


# ----------------------------------------------------------------------------------------------
# Aggregation

def stats_ms(values_s: Iterable[float]) -> Stats:
    """Mean/median/std/p90/p95/p99/min/max of second-valued samples, reported in ms."""
    a = np.asarray(list(values_s), dtype=np.float64) * 1000.0
    if a.size == 0:
        return Stats()
    p90, p95, p99 = np.percentile(a, [90, 95, 99])
    return Stats(
        count=int(a.size), mean=float(a.mean()), median=float(np.median(a)), std=float(a.std()),
        p90=float(p90), p95=float(p95), p99=float(p99), min=float(a.min()), max=float(a.max()),
    )


def peak_output_throughput(records: Sequence[RequestRecord], t0: float, bucket_s: float = 1.0) -> float:
    """Most output tokens that arrived within one ``bucket_s`` bucket (counted from t0), per second."""
    buckets: dict[int, int] = {}
    for r in records:
        for t in token_times(r):
            k = int(math.floor((t - t0) / bucket_s))
            buckets[k] = buckets.get(k, 0) + 1
    return max(buckets.values()) / bucket_s if buckets else 0.0


def peak_concurrent_requests(records: Sequence[RequestRecord]) -> int:
    """Exact maximum number of requests in flight at once (start .. last line received)."""
    events: list[tuple[float, int]] = []
    for r in records:
        if r.end is None:
            continue
        events.append((r.start, 1))
        events.append((r.end, -1))
    events.sort(key=lambda e: (e[0], e[1]))   # an end at the same instant frees the slot first
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def _rel_err(observed: float, expected: float) -> float:
    if expected == 0:
        return 0.0 if observed == 0 else math.inf
    return abs(observed - expected) / abs(expected)


def check_consistency(
    s: RunSummary,
    *,
    max_concurrency: int | None,
    num_prompts: int,
    request_rate: float,
    tolerance: float = 0.05,
) -> list[ConsistencyCheck]:
    """Cross-checks of one run (all on means over successful requests).

    1. ``e2el_tpot``: E2EL ~= TTFT + (OSL - 1) * TPOT. Exact per request by TPOT's definition, so
       on the means it fails only when OSL varies and correlates with TPOT, or the bookkeeping is off.
    2. ``e2el_itl``: E2EL ~= TTFT + (OSL - k1) * ITL (per-token ITL), k1 = mean tokens in the first
       chunk; with k1 = 1 this is the check that reproduces origin PR B's table (199 + 1023 * 11.81
       ~= 12293 ms). Fails when the recorded token gaps do not cover the decode time: a long stall
       between the last token and the end of the stream, or inconsistent ITL bookkeeping.
    3. ``steady_throughput``: output tok/s ~= C * OSL / E2EL, with C = min(max_concurrency, N).
       Holds when the server really keeps C requests in flight for the whole run. Applied only at
       request rate inf with N a multiple of C (else the last wave is partial); with N = 4C it
       typically reads ~1-3% low from the gaps between waves.
    """
    checks: list[ConsistencyCheck] = []
    lat = s.latency
    ttft_m, tpot_m, itl_m, e2el_m = (lat[k].mean for k in ("ttft", "tpot", "itl", "e2el"))
    osl = s.mean_output_len
    k1 = s.mean_first_chunk_tokens or 1.0

    def add(name: str, formula: str, observed, expected, reason: str = "") -> None:
        if observed is None or expected is None:
            checks.append(ConsistencyCheck(name, formula, observed, expected, None, tolerance, None,
                                           reason or "no data"))
            return
        err = _rel_err(observed, expected)
        checks.append(ConsistencyCheck(name, formula, observed, expected, err, tolerance, err <= tolerance))

    ok_data = e2el_m is not None and ttft_m is not None and osl is not None
    add("e2el_tpot", "mean E2EL ~= mean TTFT + (mean OSL - 1) * mean TPOT (ms)",
        e2el_m, ttft_m + (osl - 1) * tpot_m if ok_data and tpot_m is not None else None)
    add("e2el_itl", "mean E2EL ~= mean TTFT + (mean OSL - mean first-chunk tokens) * mean ITL (ms)",
        e2el_m, ttft_m + (osl - k1) * itl_m if ok_data and itl_m is not None else None)

    name, formula = "steady_throughput", "output tok/s ~= min(C, N) * mean OSL / mean E2EL"
    c = min(max_concurrency or num_prompts, num_prompts)
    if not math.isinf(request_rate):
        add(name, formula, None, None, "request rate is finite")
    elif c <= 0 or num_prompts % c != 0:
        add(name, formula, None, None, "num_prompts is not a multiple of the concurrency")
    elif s.failed:
        add(name, formula, None, None, "some requests failed")
    elif not ok_data or e2el_m <= 0:
        add(name, formula, None, None)
    else:
        add(name, formula, s.output_throughput, c * osl / (e2el_m / 1000.0))
    return checks


def summarize(
    records: Sequence[RequestRecord],
    *,
    duration_s: float,
    t0: float,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    tolerance: float = 0.05,
) -> RunSummary:
    """One run's summary from its request records.

    ``duration_s``: wall time from just before the first request was dispatched until the last
    finished. ``t0``: that start instant on the records' clock (for the 1-second peak buckets).
    """
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    out_lens = [output_len(r) for r in ok]
    in_lens = [r.prompt_len for r in ok]
    total_out, total_in = sum(out_lens), sum(in_lens)
    dur = duration_s if duration_s > 0 else math.nan

    def per_s(x: float) -> float:
        return x / dur if duration_s > 0 else 0.0

    latency = {
        "ttft": stats_ms(v for v in map(ttft, ok) if v is not None),
        "tpot": stats_ms(v for v in map(tpot, ok) if v is not None),
        "itl": stats_ms(x for r in ok for x in itl_per_token(r)),
        "itl_chunk": stats_ms(x for r in ok for x in itl_per_chunk(r)),
        "e2el": stats_ms(v for v in map(e2el, ok) if v is not None),
    }
    errors: dict[str, int] = {}
    for r in failed:
        key = r.error or "unknown error"
        errors[key] = errors.get(key, 0) + 1
    s = RunSummary(
        completed=len(ok),
        failed=len(failed),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=per_s(len(ok)),
        input_throughput=per_s(total_in),
        output_throughput=per_s(total_out),
        total_throughput=per_s(total_in + total_out),
        achieved_concurrency=per_s(sum(e2el(r) or 0.0 for r in ok)),
        peak_output_throughput=peak_output_throughput(ok, t0),
        peak_concurrent_requests=peak_concurrent_requests(records),
        mean_input_len=float(np.mean(in_lens)) if ok else None,
        mean_output_len=float(np.mean(out_lens)) if ok else None,
        mean_first_chunk_tokens=(float(np.mean([chunk_token_counts(r)[0] for r in ok if r.chunk_tokens]))
                                 if any(r.chunk_tokens for r in ok) else None),
        output_len_matches_request=all(output_len(r) == r.max_tokens for r in ok),
        token_counts_exact=all(r.tokens_from_usage or sum(r.chunk_tokens) == output_len(r) for r in ok),
        latency=latency,
        errors=errors,
    )
    with_cached = [r for r in ok if r.cached_tokens is not None]
    if with_cached:       # the server reported usage.prompt_tokens_details (vLLM, sglang, ours)
        s.total_cached_tokens = sum(r.cached_tokens for r in with_cached)
        prompt = sum(r.server_prompt_tokens or r.prompt_len for r in with_cached)
        s.prefix_cache_hit_rate = s.total_cached_tokens / prompt if prompt else None
    s.consistency = check_consistency(
        s, max_concurrency=max_concurrency, num_prompts=len(records),
        request_rate=request_rate, tolerance=tolerance,
    )
    return s
