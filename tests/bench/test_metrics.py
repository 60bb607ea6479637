"""Metric formulas on synthetic timestamps (glm_ray.bench.metrics), expected values by hand."""
import json
import math

import pytest

from glm_ray.bench import metrics as M
from glm_ray.bench.metrics import RequestRecord


def rec(start, chunks, end, *, prompt_len=8, max_tokens=None, output_len=None, exact=True, success=True,
        error=""):
    """chunks: [(time, tokens), ...]"""
    times = [t for t, _ in chunks]
    toks = [n for _, n in chunks]
    out = sum(toks) if output_len is None else output_len
    return RequestRecord(prompt_len=prompt_len, max_tokens=out if max_tokens is None else max_tokens,
                         start=start, end=end, chunk_times=times, chunk_tokens=toks, output_len=out,
                         tokens_from_usage=exact, success=success, error=error)


# Two requests. A: one token per chunk. B: multi-token chunks (1, 3, 2 tokens).
A = rec(0.0, [(0.1, 1), (0.2, 1), (0.3, 1), (0.4, 1)], 0.41)
B = rec(1.0, [(1.2, 1), (1.5, 3), (1.9, 2)], 2.0)


def test_per_request_quantities():
    assert M.ttft(A) == pytest.approx(0.1)
    assert M.e2el(A) == pytest.approx(0.41)
    assert M.tpot(A) == pytest.approx((0.41 - 0.1) / 3)
    assert M.itl_per_token(A) == pytest.approx([0.1, 0.1, 0.1])

    assert M.ttft(B) == pytest.approx(0.2)
    assert M.e2el(B) == pytest.approx(1.0)
    assert M.tpot(B) == pytest.approx(0.8 / 5)
    # sglang-native: the 0.3 s gap is split over 3 tokens, the 0.4 s gap over 2
    assert M.itl_per_token(B) == pytest.approx([0.1, 0.1, 0.1, 0.2, 0.2])
    # vLLM / sglang-oai: one gap per chunk
    assert M.itl_per_chunk(B) == pytest.approx([0.3, 0.4])
    assert M.token_times(B) == pytest.approx([1.2, 1.3, 1.4, 1.5, 1.7, 1.9])


def test_tpot_undefined_for_single_token():
    r = rec(0.0, [(0.05, 1)], 0.06)
    assert M.tpot(r) is None
    assert M.itl_per_token(r) == []


def test_summary_exact_values():
    s = M.summarize([A, B], duration_s=2.0, t0=0.0, max_concurrency=1, tolerance=0.05)
    L = s.latency
    assert (s.completed, s.failed) == (2, 0)
    assert s.total_input_tokens == 16 and s.total_output_tokens == 10
    assert s.output_throughput == pytest.approx(5.0)
    assert s.input_throughput == pytest.approx(8.0)
    assert s.total_throughput == pytest.approx(13.0)
    assert s.request_throughput == pytest.approx(1.0)
    assert s.achieved_concurrency == pytest.approx((0.41 + 1.0) / 2.0)
    assert s.peak_concurrent_requests == 1
    assert s.peak_output_throughput == pytest.approx(6.0)     # bucket [1 s, 2 s) holds B's 6 tokens
    assert s.mean_output_len == pytest.approx(5.0)

    assert L["ttft"].mean == pytest.approx(150.0)
    assert L["ttft"].median == pytest.approx(150.0)
    assert L["ttft"].std == pytest.approx(50.0)               # population std
    assert L["ttft"].p90 == pytest.approx(190.0)              # linear interpolation
    assert L["ttft"].p99 == pytest.approx(199.0)
    assert L["e2el"].mean == pytest.approx(705.0)
    assert L["tpot"].mean == pytest.approx((310.0 / 3 + 160.0) / 2)

    # per-token pool: six 100 ms values, two 200 ms values
    assert L["itl"].count == 8
    assert L["itl"].mean == pytest.approx(125.0)
    assert L["itl"].median == pytest.approx(100.0)
    assert L["itl"].p90 == pytest.approx(200.0)
    assert L["itl"].max == pytest.approx(200.0)
    # per-chunk pool: 100, 100, 100, 300, 400
    assert L["itl_chunk"].count == 5
    assert L["itl_chunk"].mean == pytest.approx(200.0)
    assert L["itl_chunk"].median == pytest.approx(100.0)
    assert L["itl_chunk"].p90 == pytest.approx(360.0)
    assert L["itl_chunk"].p99 == pytest.approx(396.0)


def test_chunk_token_reconciliation_without_per_chunk_usage():
    def r(n_chunks, total):
        return rec(0.0, [(0.1 * (i + 1), 1) for i in range(n_chunks)], 1.0, output_len=total, exact=False)

    assert M.chunk_token_counts(r(3, 3)) == [1, 1, 1]
    assert M.chunk_token_counts(r(3, 7)) == [1, 3, 3]
    assert M.chunk_token_counts(r(3, 8)) == [1, 4, 3]     # remainder goes to the earlier chunks
    assert M.chunk_token_counts(r(1, 5)) == [5]
    assert M.chunk_token_counts(r(4, 2)) == [1, 1, 1, 1]  # fewer tokens than chunks: keep counts
    exact = rec(0.0, [(0.1, 2), (0.2, 2)], 0.3, output_len=4, exact=True)
    assert M.chunk_token_counts(exact) == [2, 2]
    # the estimated split feeds the per-token ITL: gaps of 0.1 s spread over 3 tokens each
    assert M.itl_per_token(r(3, 7)) == pytest.approx([0.1 / 3] * 6)


def steady_run(conc=2, waves=2, osl=5, ttft=0.1, gap=0.05, tail=0.001):
    """Lock-step waves: C requests start together, each takes ttft + (osl-1)*gap + tail."""
    e2e = ttft + (osl - 1) * gap + tail
    recs = []
    for w in range(waves):
        st = w * e2e
        for _ in range(conc):
            chunks = [(st + ttft + i * gap, 1) for i in range(osl)]
            recs.append(rec(st, chunks, st + e2e))
    return recs, waves * e2e


def test_consistency_passes_on_steady_run():
    recs, dur = steady_run()
    s = M.summarize(recs, duration_s=dur, t0=0.0, max_concurrency=2, request_rate=math.inf)
    checks = {c.name: c for c in s.consistency}
    assert all(c.ok for c in s.consistency), s.consistency
    assert checks["e2el_itl"].expected == pytest.approx(100.0 + 4 * 50.0)
    assert checks["e2el_itl"].observed == pytest.approx(301.0)
    assert checks["steady_throughput"].expected == pytest.approx(2 * 5 / 0.301)
    assert checks["steady_throughput"].observed == pytest.approx(20 / 0.602)
    assert s.consistent
    assert s.peak_concurrent_requests == 2
    assert s.achieved_concurrency == pytest.approx(2.0)


def test_consistency_fails_on_stall_before_done():
    # tokens arrive at 0.1 and 0.15, but the stream only ends at 1.0: ITL misses most of the time
    recs = [rec(0.0, [(0.1, 1), (0.15, 1)], 1.0) for _ in range(2)]
    s = M.summarize(recs, duration_s=1.0, t0=0.0, max_concurrency=2)
    checks = {c.name: c for c in s.consistency}
    assert checks["e2el_tpot"].ok is True          # TPOT absorbs the stall by definition
    assert checks["e2el_itl"].ok is False
    assert checks["e2el_itl"].expected == pytest.approx(150.0)
    assert checks["e2el_itl"].observed == pytest.approx(1000.0)
    assert not s.consistent


def test_consistency_fails_when_server_serialises():
    # C=2 requested, but the server runs one request at a time: the second one waits
    r1 = rec(0.0, [(0.1 + 0.1 * i, 1) for i in range(5)], 0.5)
    r2 = rec(0.0, [(0.6 + 0.1 * i, 1) for i in range(5)], 1.0)
    s = M.summarize([r1, r2], duration_s=1.0, t0=0.0, max_concurrency=2)
    c = {c.name: c for c in s.consistency}["steady_throughput"]
    assert c.observed == pytest.approx(10.0)
    assert c.expected == pytest.approx(2 * 5 / 0.75)
    assert c.ok is False


def test_output_length_mismatch_is_reported():
    # 3 text chunks, no usage, no finish_reason: the output length stays the chunk count, which
    # differs from max_tokens; the summary says so
    r = rec(0.0, [(0.1, 1), (0.2, 1), (0.3, 1)], 0.3, max_tokens=9, exact=False)
    s = M.summarize([r], duration_s=0.3, t0=0.0, max_concurrency=1)
    assert not s.output_len_matches_request


def test_first_chunk_with_several_tokens():
    # 4 tokens arrive with the first chunk (e.g. held back by the detokenizer): they get no ITL entry,
    # so the ITL check uses OSL - 4, not OSL - 1
    r = rec(0.0, [(0.1, 4), (0.2, 2), (0.3, 2)], 0.3)
    s = M.summarize([r], duration_s=0.3, t0=0.0, max_concurrency=1)
    assert s.mean_first_chunk_tokens == 4
    assert s.latency["itl"].count == 4 and s.latency["itl"].mean == pytest.approx(50.0)
    c = {c.name: c for c in s.consistency}["e2el_itl"]
    assert c.expected == pytest.approx(100.0 + 4 * 50.0) and c.ok is True
    # TPOT spreads the same decode time over OSL - 1 tokens
    assert s.latency["tpot"].mean == pytest.approx(200.0 / 7)


def test_steady_check_not_applicable():
    recs, dur = steady_run()
    s = M.summarize(recs, duration_s=dur, t0=0.0, max_concurrency=2, request_rate=4.0)
    c = {c.name: c for c in s.consistency}["steady_throughput"]
    assert c.ok is None and "finite" in c.reason
    s = M.summarize(recs[:3], duration_s=dur, t0=0.0, max_concurrency=2)
    c = {c.name: c for c in s.consistency}["steady_throughput"]
    assert c.ok is None and "multiple" in c.reason


def test_failed_requests_are_counted_not_measured():
    recs, dur = steady_run()
    bad = RequestRecord(prompt_len=8, max_tokens=5, start=0.0, end=0.01, success=False,
                        error="HTTP 500: boom", http_status=500)
    s = M.summarize(recs + [bad, bad], duration_s=dur, t0=0.0, max_concurrency=2)
    assert (s.completed, s.failed) == (4, 2)
    assert s.errors == {"HTTP 500: boom": 2}
    assert s.latency["ttft"].count == 4
    assert s.total_input_tokens == 32
    c = {c.name: c for c in s.consistency}["steady_throughput"]
    assert c.ok is None


def test_empty_run_and_json():
    s = M.summarize([], duration_s=0.0, t0=0.0)
    d = s.to_dict()
    assert d["completed"] == 0 and d["mean_ttft_ms"] is None and d["output_throughput"] == 0.0
    json.dumps(d, allow_nan=False)

    recs, dur = steady_run()
    d = M.summarize(recs, duration_s=dur, t0=0.0, max_concurrency=2).to_dict()
    for key in ("mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                "mean_itl_ms", "p99_itl_ms", "max_itl_ms", "mean_itl_chunk_ms", "mean_e2el_ms",
                "median_e2el_ms", "p90_e2el_ms", "p99_e2el_ms", "output_throughput", "total_throughput",
                "request_throughput", "consistent"):
        assert key in d
    json.dumps(d, allow_nan=False)


def test_record_roundtrip():
    d = B.to_dict(t0=1.0)
    assert d["start"] == 0.0 and d["chunk_times"] == pytest.approx([0.2, 0.5, 0.9])
    r = RequestRecord.from_dict(json.loads(json.dumps(d)))
    assert M.itl_per_token(r) == pytest.approx(M.itl_per_token(B))
