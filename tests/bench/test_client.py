"""The client against an in-process stand-in OpenAI server (aiohttp): SSE parsing, token counting,
usage fallbacks, errors, the sweep driver, the datasets as sent (ShareGPT through the server's
/tokenize, shared prefixes), no concurrency limit, ignore_eos off, non-streamed answers, the chat API.
No Ray, no model; a few ms of fake decode per token; the stand-in tokenizes one token per word."""
import asyncio
import contextlib
import json
import threading
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from glm_ray.bench import cli, report
from glm_ray.bench import client as C
from glm_ray.bench.client import BenchConfig, BenchError
from glm_ray.bench.datasets import DatasetError


def words(text):
    """The stand-in's tokenizer: one token per word, id = word length (< 1000)."""
    return [min(len(w), 999) for w in text.split()]


def make_app(*, tokens_per_chunk=1, reject_continuous=False, send_usage=True, step_s=0.002, seen=None,
             prefix_cache=None):
    """prefix_cache: a set; the stand-in then reports usage.prompt_tokens_details.cached_tokens as the
    longest earlier prompt prefix in whole 4-token blocks (a block-granular prefix cache)."""
    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "stand-in", "object": "model"}]})

    async def tokenize(request):
        body = await request.json()
        ids = ([0] if body.get("add_special_tokens", True) else []) + words(body["prompt"])
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": 4096})

    async def detokenize(request):
        body = await request.json()
        return web.json_response({"prompt": " ".join("w" * max(t, 1) for t in body["tokens"])})

    async def completions(request):
        body = await request.json()
        if seen is not None:
            seen.append(body)
        chat = "messages" in body
        so = body.get("stream_options") or {}
        if reject_continuous and "continuous_usage_stats" in so:
            return web.json_response({"detail": "extra fields not permitted"}, status=422)
        prompt_tokens = len(words(body["messages"][0]["content"])) + 3 if chat else len(body["prompt"])
        if not chat and any(t >= 1000 for t in body["prompt"]):
            return web.json_response({"error": {"message": "token id out of range"}}, status=400)
        n, cont = body["max_tokens"], bool(so.get("continuous_usage_stats"))
        usage_extra = {}
        if prefix_cache is not None and not chat:
            p = tuple(body["prompt"])
            cuts = range(4, len(p), 4)                      # the last token is always computed
            cached = max([k for k in cuts if p[:k] in prefix_cache], default=0)
            prefix_cache.update(p[:k] for k in cuts)
            usage_extra = {"prompt_tokens_details": {"cached_tokens": cached}}
        if not body.get("stream"):
            await asyncio.sleep(step_s * n)
            choice = ({"index": 0, "message": {"role": "assistant", "content": "x" * n}} if chat
                      else {"index": 0, "text": "x" * n})
            return web.json_response({"choices": [dict(choice, finish_reason="length")],
                                      "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                                **usage_extra}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        done = 0
        while done < n:
            k = min(tokens_per_chunk if done else 1, n - done)   # first token alone, then chunks of k
            await asyncio.sleep(step_s * k)
            done += k
            choice = {"index": 0, "delta": {"content": "x" * k}} if chat else {"index": 0, "text": "x" * k}
            chunk = {"choices": [dict(choice, finish_reason="length" if done == n else None)]}
            if cont:
                chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": done}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if send_usage and so.get("include_usage"):
            u = {"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n, **usage_extra}}
            await resp.write(f"data: {json.dumps(u)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def fail500(request):
        return web.Response(status=500, text="engine exploded")

    async def midstream_error(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n')
        await resp.write(b'data: {"error": {"message": "out of KV cache"}}\n\n')
        return resp

    async def truncated(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n')
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/fail500", fail500)
    app.router.add_post("/midstream", midstream_error)
    app.router.add_post("/truncated", truncated)
    return app


async def with_server(app, fn):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        return await fn(f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


def run(app, fn):
    return asyncio.run(with_server(app, fn))


def cfg(base, **kw):
    kw.setdefault("warmup_pause_s", 0.0)
    kw.setdefault("show_progress", False)
    return BenchConfig(base_url=base, **kw)


async def one_request(base, endpoint="/v1/completions", max_tokens=9, per_chunk=True):
    c = cfg(base)
    async with C._session(c) as s:
        rec = C.RequestRecord(prompt_len=4, max_tokens=max_tokens)
        return await C.send_request(s, base + endpoint, C._payload(c, "stand-in", [1, 2, 3, 4], max_tokens,
                                                                     per_chunk), rec)


def test_multi_token_chunks_counted_from_per_chunk_usage():
    r = run(make_app(tokens_per_chunk=4), lambda b: one_request(b, max_tokens=9))
    assert r.success, r.error
    assert r.chunk_tokens == [1, 4, 4] and r.tokens_from_usage
    assert r.output_len == 9 and r.output_len_source == "usage"
    assert r.start < r.chunk_times[0] < r.chunk_times[-1] <= r.end


def test_text_chunks_without_per_chunk_usage():
    r = run(make_app(tokens_per_chunk=4), lambda b: one_request(b, max_tokens=9, per_chunk=False))
    assert r.success
    assert r.chunk_tokens == [1, 1, 1] and not r.tokens_from_usage
    assert r.output_len == 9                      # from the final usage chunk
    from glm_ray.bench.metrics import chunk_token_counts
    assert chunk_token_counts(r) == [1, 4, 4]


def test_no_usage_at_all_uses_finish_reason_length():
    r = run(make_app(tokens_per_chunk=2, send_usage=False), lambda b: one_request(b, max_tokens=5, per_chunk=False))
    assert r.success
    assert r.output_len == 5 and r.output_len_source == "finish_reason=length"


@pytest.mark.parametrize("endpoint, expect", [
    ("/fail500", "HTTP 500: engine exploded"),
    ("/midstream", "stream error"),
    ("/truncated", "stream ended early"),
])
def test_errors_are_failed_requests_with_the_body(endpoint, expect):
    r = run(make_app(), lambda b: one_request(b, endpoint=endpoint))
    assert not r.success
    assert r.error.startswith(expect)
    assert r.end is not None


def test_request_body_is_what_sglang_and_vllm_send():
    seen = []
    run(make_app(seen=seen), lambda b: one_request(b, max_tokens=3))
    body = seen[0]
    assert body["prompt"] == [1, 2, 3, 4] and body["max_tokens"] == 3
    assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["stream"] is True
    assert body["stream_options"]["include_usage"] is True
    assert set(body) == {"model", "prompt", "max_tokens", "temperature", "ignore_eos", "stream", "stream_options"}


def test_probe_resolves_model_and_falls_back_when_continuous_usage_refused():
    async def go(base):
        async with C._session(cfg(base)) as s:
            return await C.probe_server(s, cfg(base))

    info = run(make_app(), go)
    assert info.model == "stand-in" and info.usage_per_chunk and info.vocab_source == "default"
    info = run(make_app(reject_continuous=True), go)
    assert info.model == "stand-in" and not info.usage_per_chunk


def test_unreachable_server_is_one_clear_error():
    with pytest.raises(BenchError, match="cannot reach server at http://127.0.0.1:9"):
        C.run_sweep(BenchConfig(base_url="http://127.0.0.1:9", show_progress=False))


def test_bad_vocab_fails_at_readiness():
    with pytest.raises(BenchError, match="HTTP 400"):
        run(make_app(), lambda b: C.run_sweep_async(cfg(b, vocab_size=100000, exclude_token_ids=())))


def test_sweep_end_to_end():
    seen = []

    async def go(base):
        return await C.run_sweep_async(cfg(base, input_len=16, output_len=6, concurrencies=(1, 2), repetitions=2,
                                           warmup_requests=1, vocab_size=1000))

    server, results = run(make_app(tokens_per_chunk=2, seen=seen), go)
    assert [(r.concurrency, r.repetition, r.num_prompts) for r in results] == [(1, 0, 4), (1, 1, 4), (2, 0, 8), (2, 1, 8)]
    for r in results:
        s = r.summary
        assert s.completed == r.num_prompts and s.failed == 0
        assert s.output_len_matches_request and s.token_counts_exact
        assert s.peak_concurrent_requests <= r.concurrency
        assert s.latency["ttft"].mean > 0
    # one probe (4-token prompt), then per run 1 warm-up + N requests; every prompt distinct
    bench = [b for b in seen if b["max_tokens"] == 6 and len(b["prompt"]) == 16]
    assert len(seen) == 1 + len(bench)
    assert len(bench) == 2 * (1 + 4) + 2 * (1 + 8)
    prompts = {tuple(b["prompt"]) for b in bench}
    assert len(prompts) == len(bench)


def test_poisson_arrivals_spread_the_starts():
    async def go(base):
        return await C.run_sweep_async(cfg(base, input_len=4, output_len=2, concurrencies=(8,), num_prompts=8,
                                           request_rate=200.0, warmup_requests=0, vocab_size=1000))

    _, (res,) = run(make_app(), go)
    starts = sorted(r.start for r in res.records)
    assert starts[-1] - starts[0] > 0.005      # 7 exponential gaps of mean 5 ms
    assert res.summary.completed == 8


def test_lengths_and_prompts():
    rng = np.random.default_rng(0)
    assert C.sample_lengths(rng, 5, 100, 1.0) == [100] * 5
    ls = C.sample_lengths(rng, 2000, 100, 0.0)            # sglang default: uniform [1, 100]
    assert min(ls) == 1 and max(ls) == 100
    ls = C.sample_lengths(rng, 2000, 100, 0.5)
    assert min(ls) == 50 and max(ls) == 100
    ps = C.random_prompts(rng, [3000], 10, exclude=[0, 3, 9])
    assert set(ps[0]) == {1, 2, 4, 5, 6, 7, 8}
    a = C.random_prompts(np.random.default_rng([42, 4, 0]), [16], 1000)
    b = C.random_prompts(np.random.default_rng([42, 4, 0]), [16], 1000)
    assert a == b
    with pytest.raises(DatasetError):
        C.random_prompts(rng, [3], 2, exclude=[0, 1])


SHAREGPT = Path(__file__).parent / "data" / "sharegpt_small.json"


def sweep(app, **kw):
    kw.setdefault("vocab_size", 1000)
    return run(app, lambda b: C.run_sweep_async(cfg(b, **kw)))


def test_sharegpt_through_the_servers_tokenize():
    """Prompts are the human turns tokenized by the server (special tokens on: what it adds to text), output
    lengths the gpt turns' token counts (no special tokens); too-short pairs are skipped (sglang's rule)."""
    seen = []
    data = json.loads(SHAREGPT.read_text())
    convs = [c.get("conversations", c.get("conversation")) for c in data]
    usable = {turns[0]["value"]: len(words(turns[1]["value"])) for turns in convs
              if len(turns) >= 2 and len(words(turns[1]["value"])) >= 2}     # prompts: >= 1 word + special
    server, (res,) = sweep(make_app(seen=seen), dataset="sharegpt", dataset_path=str(SHAREGPT), num_prompts=100,
                           concurrencies=(4,), warmup_requests=0)
    assert server.dataset_rows == len(usable) == res.num_prompts < len(data)     # fewer than asked: no oversampling
    bench = [b for b in seen if len(b["prompt"]) > 4]
    assert len(bench) == len(usable)
    by_words = {tuple(b["prompt"]): b["max_tokens"] for b in bench}
    for text, out_len in usable.items():
        assert by_words[tuple([0] + words(text))] == out_len
    assert res.summary.completed == len(usable) and res.summary.total_input_tokens == sum(len(p) for p in by_words)


def test_sharegpt_fixed_output_len_and_context_len():
    seen = []
    _, (res,) = sweep(make_app(seen=seen), dataset="sharegpt", dataset_path=str(SHAREGPT), num_prompts=3,
                      concurrencies=(2,), warmup_requests=0, sharegpt_output_len=5, sharegpt_context_len=12)
    assert res.num_prompts == 3 and {b["max_tokens"] for b in seen[1:]} == {5}
    assert all(len(b["prompt"]) + 5 <= 12 for b in seen[1:])


def test_sharegpt_needs_a_file():
    with pytest.raises(BenchError, match="needs --dataset-path"):
        C.run_sweep(BenchConfig(dataset="sharegpt", show_progress=False))
    with pytest.raises(BenchError, match="cannot read"):
        sweep(make_app(), dataset="sharegpt", dataset_path="/nonexistent.json", num_prompts=2)


def test_generated_shared_prefix_requests():
    seen = []
    _, (res,) = sweep(make_app(seen=seen), dataset="generated-shared-prefix", gsp_num_groups=3,
                      gsp_prompts_per_group=4, gsp_system_prompt_len=20, gsp_question_len=5, gsp_output_len=3,
                      num_prompts=999, concurrencies=(4,), warmup_requests=0)
    bench = [b["prompt"] for b in seen if len(b["prompt"]) == 25]
    assert res.num_prompts == 12 and len(bench) == 12 and {b["max_tokens"] for b in seen[1:]} == {3}
    prefixes = {tuple(p[:20]) for p in bench}
    assert len(prefixes) == 3 and all(sum(tuple(p[:20]) == pre for p in bench) == 4 for pre in prefixes)


def test_prefix_cache_hits_from_usage_cached_tokens():
    """The run's hit rate is the server's usage.prompt_tokens_details.cached_tokens over its prompt tokens:
    one request at a time, each group's first prompt misses, the other three reuse its 20-token prefix."""
    _, (res,) = sweep(make_app(prefix_cache=set()), dataset="generated-shared-prefix", gsp_num_groups=3,
                      gsp_prompts_per_group=4, gsp_system_prompt_len=20, gsp_question_len=5, gsp_output_len=3,
                      concurrencies=(1,), warmup_requests=0)
    s = res.summary
    assert [r.cached_tokens for r in res.records].count(0) == 3 and s.total_cached_tokens == 3 * 3 * 20
    assert s.prefix_cache_hit_rate == pytest.approx(180 / (12 * 25))
    _, (plain,) = sweep(make_app(), dataset="random", num_prompts=2, concurrencies=(1,), warmup_requests=0)
    assert plain.summary.total_cached_tokens is None and plain.summary.prefix_cache_hit_rate is None


def test_no_concurrency_limit_sends_everything_at_once():
    _, (res,) = sweep(make_app(step_s=0.01), input_len=4, output_len=4, concurrencies=(None,), num_prompts=6,
                      warmup_requests=1)
    assert res.concurrency is None and res.summary.completed == 6
    assert res.summary.peak_concurrent_requests == 6


def test_disable_ignore_eos_and_stream():
    seen = []
    _, (res,) = sweep(make_app(seen=seen), input_len=4, output_len=5, concurrencies=(2,), num_prompts=2,
                      ignore_eos=False, stream=False, warmup_requests=0)
    probe, *bench = seen
    assert all(b["ignore_eos"] is False and b["stream"] is False and "stream_options" not in b for b in seen)
    s = res.summary
    assert s.completed == 2 and s.total_output_tokens == 10 and s.output_len_matches_request
    # one answer per request: TTFT = E2E latency (to the answer), no ITL (sglang's --disable-stream)
    assert s.latency["itl"].count == 0 and s.latency["ttft"].mean == pytest.approx(s.latency["e2el"].mean, rel=0.05)


def test_chat_backend_sends_messages():
    """Random ids are detokenized by the server for the chat API; the input length is the server's count."""
    seen = []
    _, (res,) = sweep(make_app(seen=seen, tokens_per_chunk=2), api="chat", endpoint="/v1/chat/completions",
                      input_len=6, output_len=5, concurrencies=(2,), num_prompts=2, warmup_requests=0)
    bench = seen[1:]
    assert all(b["messages"][0]["role"] == "user" and "prompt" not in b for b in bench)
    assert [len(b["messages"][0]["content"].split()) for b in bench] == [6, 6]
    s = res.summary
    assert s.completed == 2 and s.total_output_tokens == 10 and s.token_counts_exact
    assert s.total_input_tokens == 2 * (6 + 3)                  # the stand-in's usage.prompt_tokens


@contextlib.contextmanager
def served(app):
    """The stand-in on its own event loop in a thread, for code that runs its own loop (cli.main)."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)


def test_cli_single_run_prints_the_block_and_writes_sglang_lines(tmp_path, capsys):
    out_file = tmp_path / "o.jsonl"
    with served(make_app(tokens_per_chunk=2)) as base:
        rc = cli.main(["--base-url", base, "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2",
                       "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "12", "--gsp-question-len", "4",
                       "--gsp-output-len", "5", "--max-concurrency", "3", "--output-file", str(out_file),
                       "--output-details", "--disable-tqdm", "--no-plot", "--warmup-pause", "0"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "============ Serving Benchmark Result ============" in out and "Successful requests:" in out
    (row,) = report.load_jsonl(out_file)
    assert row["dataset_name"] == "generated-shared-prefix" and row["gsp_num_groups"] == 2 and row["completed"] == 6
    assert row["input_lens"] == [16] * 6 and row["output_lens"] == [5] * 6 and row["request_errors"] == [""] * 6
    assert len(row["ttfts"]) == 6 and all(len(x) == 4 for x in row["itls"]) and row["errors"] == {}
    assert row["duration"] == row["duration_s"] and row["max_concurrency"] == 3
