"""The failure scenarios against the served apps: a Ray driver for Router stats and worker kills,
4x KV overload, disconnect storms, injected step faults, worker kill mid-stream, and the soak."""

import concurrent.futures as cf
import http.client
import json
import math
import random
import statistics
import threading
import time
from typing import Iterable, Optional
from urllib.parse import urlsplit

import requests

from tests.reliability.apps import EXCEPTION_TOKEN, FAULT_TOKENS, OOM_TOKEN, SAMPLE_TOKEN
from tests.reliability.client import (
    HostileRequest,
    Reply,
    _assert_loopback,
    _local,
    _retry_after_ok,
    _session,
    chat,
    check_error_body,
    check_reply,
    completion,
    dumps,
    is_healthy,
    leaks,
    post_json,
    send,
    sse_events,
)
from tests.reliability.hostile import JSON

# ------------------------------------------------------------------------------------------------
# Ray driver: the Router's stats, actors and their processes
# ------------------------------------------------------------------------------------------------


class RayDriver:
    """`with RayDriver(cluster.gcs_address, cluster.dashboard_url) as rd: rd.stats("faults")`.

    The state API is always given this cluster's dashboard address: without one it picks the latest
    Ray instance on the machine, which may be somebody else's."""

    def __init__(self, gcs_address: str, dashboard_url: str):
        self.gcs_address, self.dashboard_url = gcs_address, dashboard_url
        self._handles: dict = {}

    def __enter__(self) -> "RayDriver":
        import logging

        import ray
        ray.init(address=self.gcs_address, log_to_driver=False, logging_level=logging.WARNING)
        return self

    def __exit__(self, *exc) -> None:
        import ray
        self._handles.clear()
        ray.shutdown()

    def stats(self, app: str, timeout: float = 10.0) -> dict:
        from ray import serve
        h = self._handles.get(app)
        if h is None:
            h = self._handles[app] = serve.get_deployment_handle("Router", app_name=app)
        return h.stats.remote().result(timeout_s=timeout)

    def kv_capacity(self, app: str) -> int:
        """The app's KV capacity in tokens, as its Router reports it (stats()["kv_capacity_tokens"])."""
        s = self.stats(app)
        if not s.get("kv_capacity_tokens"):
            raise AssertionError(f"the Router of {app!r} reports no kv_capacity_tokens in stats(): {sorted(s)}")
        return int(s["kv_capacity_tokens"])

    def wait_idle(self, app: str, timeout: float) -> tuple[Optional[float], dict]:
        """Seconds until running == waiting == 0 and kv_usage == 0 (None if not within timeout)."""
        t0 = time.monotonic()
        s: dict = {}
        while True:
            try:
                s = self.stats(app)
                if s["running"] == 0 and s["waiting"] == 0 and s["kv_usage"] == 0:
                    return time.monotonic() - t0, s
            except Exception as e:  # noqa: BLE001  (a dead replica: keep polling until timeout)
                s = {"error": repr(e)[:200]}
            if time.monotonic() - t0 > timeout:
                return None, s
            time.sleep(0.05)

    def worker_actor_names(self, app: str) -> list[tuple[str, str]]:
        import ray
        return [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(f"glm-ray-worker:{app}:")]

    def kill_workers(self, app: str) -> int:
        import ray
        names = self.worker_actor_names(app)
        for name, ns in names:
            ray.kill(ray.get_actor(name, namespace=ns))
        return len(names)

    def serving_processes(self, apps: Iterable[str]) -> dict[str, int]:
        """{label: pid} of the processes that serve `apps`: each app's Router, ingress and TP
        workers, and the HTTP proxy."""
        from ray.util.state import list_actors
        apps = list(apps)
        out = {}
        for a in list_actors(address=self.dashboard_url, filters=[("state", "=", "ALIVE")], detail=True,
                             limit=10_000):
            cls, name, pid = a.class_name or "", a.name or "", a.pid
            if cls == "ProxyActor":
                out["proxy"] = pid
            for app in apps:
                if cls == f"ServeReplica:{app}:Router":
                    out[f"{app}/router"] = pid
                elif cls == f"ServeReplica:{app}:OpenAIIngress":
                    out[f"{app}/ingress"] = pid
                elif cls == "WorkerActor" and name.startswith(f"glm-ray-worker:{app}:"):
                    out[f"{app}/worker{name.rsplit(':rank', 1)[-1]}"] = pid
        return out


class StatsSampler:
    """Polls one app's Router stats in the background: peaks of running/waiting/kv_usage."""

    def __init__(self, rd: RayDriver, app: str, every: float = 0.1):
        self.rd, self.app, self.every = rd, app, every
        self.peak = {"running": 0, "waiting": 0, "kv_usage": 0.0}
        self.preemptions = (None, None)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        first = None
        while not self._stop.is_set():
            try:
                s = self.rd.stats(self.app)
                for k in self.peak:
                    self.peak[k] = max(self.peak[k], s[k])
                p = s.get("num_preemptions")
                first = p if first is None else first
                self.preemptions = (first, p)
            except Exception:  # noqa: BLE001
                pass
            self._stop.wait(self.every)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(5)


# ------------------------------------------------------------------------------------------------
# Normal traffic helpers
# ------------------------------------------------------------------------------------------------


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 890) for _ in range(n)]     # below the fault tokens (900..902)


def classify_generation(reply: Reply, max_tokens: Optional[int] = None) -> tuple[str, str]:
    """("completed" | "rejected" | "lost", detail) for a generation request.

    completed: 200 with every choice finished ("length"/"stop"), a stream ending in [DONE] with no
    error event; rejected: 429, or 503 + Retry-After with a "busy" code (OVERLOAD_CODES), in OpenAI's
    shape; lost: anything else (a 503 of an engine that is down included)."""
    if reply.status is None:
        return "lost", f"no response: {reply.transport_error}"
    problems = check_reply(None, reply)
    if reply.status in (429, 503):
        if problems:
            return "lost", f"{reply.status} not clean: {problems}"
        return "rejected", f"{reply.status}"
    if reply.status != 200 or problems:
        return "lost", f"{reply.status}: {problems} {reply.text[:200]!r}"
    if reply.headers.get("content-type", "").startswith("text/event-stream"):
        events, _ = sse_events(reply.body)
        finishes = [c.get("finish_reason") for e in events for c in (e.get("choices") or []) if c.get("finish_reason")]
        if not finishes:
            return "lost", "stream ended without a finish_reason"
        return "completed", ",".join(finishes)
    try:
        obj = reply.json()
        fins = [c["finish_reason"] for c in obj["choices"]]
        toks = obj["usage"]["completion_tokens"]
    except (ValueError, KeyError, TypeError) as e:
        return "lost", f"malformed 200 body: {e!r} {reply.text[:200]!r}"
    if any(f not in ("length", "stop") for f in fins):
        return "lost", f"finish_reason {fins}"
    if max_tokens is not None and fins == ["length"] and toks != max_tokens:
        return "lost", f"finish 'length' after {toks} of {max_tokens} tokens"
    return "completed", ",".join(fins)


# ------------------------------------------------------------------------------------------------
# Scenario: 4x KV overload
# ------------------------------------------------------------------------------------------------


def run_overload(base_url: str, model: str, rd: RayDriver, app: str, max_model_len: int, factor: float = 4.0,
                 prompt_len: int = 64, max_tokens: int = 192, seed: int = 0, timeout: float = 600.0) -> dict:
    """ceil(factor x KV capacity / (prompt + max_tokens)) requests at once (half streaming, half
    chat/completions); each must complete or get a clean 429/503. Then the KV must be empty again."""
    capacity = rd.kv_capacity(app)
    per = prompt_len + max_tokens
    assert per <= max_model_len, (per, max_model_len)
    n = math.ceil(factor * capacity / per)
    rng = random.Random(seed)
    bodies = []
    for i in range(n):
        ids = _ids(rng, prompt_len)
        common = dict(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=FAULT_TOKENS, stream=bool(i % 2),
                      temperature=1.0, seed=i)
        if i % 4 == 3:      # a chat request: its prompt is a text of about prompt_len tokens
            body = {"model": model, "messages": [{"role": "user", "content": " ".join(["word"] * (prompt_len - 16))}],
                    **common}
            bodies.append(("/v1/chat/completions", body))
        else:
            bodies.append(("/v1/completions", completion(model, ids, **common)))
    t0 = time.monotonic()
    with StatsSampler(rd, app) as sampler, cf.ThreadPoolExecutor(min(n, 128)) as pool:
        replies = list(pool.map(lambda b: post_json(base_url, b[0], b[1], timeout), bodies))
    elapsed = time.monotonic() - t0
    outcomes = {"completed": 0, "rejected": 0, "lost": 0}
    lost = []
    for (path, body), reply in zip(bodies, replies):
        what, detail = classify_generation(reply, max_tokens)
        outcomes[what] += 1
        if what == "lost":
            lost.append(f"{path} stream={body['stream']}: {detail}")
    idle_s, last = rd.wait_idle(app, timeout=10)
    p0, p1 = sampler.preemptions
    return {"kv_capacity_tokens": capacity, "requests": n,
            "tokens_requested": n * per, "factor": round(n * per / capacity, 2), **outcomes,
            "lost_examples": lost[:10], "peak": sampler.peak,
            "preemptions": (p1 - p0) if (p0 is not None and p1 is not None) else None,
            "seconds": round(elapsed, 1), "idle_after_s": idle_s, "stats_after": _brief(last),
            "alive_after": is_healthy(base_url, model)[0]}


def _brief(s: dict) -> dict:
    return {k: s[k] for k in ("running", "waiting", "kv_usage", "error") if k in s}


# ------------------------------------------------------------------------------------------------
# Scenario: disconnect storm
# ------------------------------------------------------------------------------------------------


def _stream_then_disconnect(base_url: str, path: str, body: dict, chunks: int, budget_s: float) -> dict:
    """Open an SSE stream with a raw connection, read `chunks` data events, then drop the socket."""
    u = urlsplit(base_url.rstrip("/") + path)
    _assert_loopback(base_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=budget_s)
    t0 = time.monotonic()
    seen, status, events = 0, None, []
    try:
        conn.request("POST", u.path, body=dumps(body), headers=JSON)
        resp = conn.getresponse()
        status = resp.status
        if status == 200:
            while seen < chunks and time.monotonic() - t0 < budget_s:
                line = resp.fp.readline()
                if not line:
                    break
                if line.startswith(b"data:"):
                    events.append(line[:300].decode("utf-8", "replace").strip())
                    seen += b"[DONE]" not in line and b'"error"' not in line
        else:
            events.append(resp.read(300).decode("utf-8", "replace"))
    except (OSError, http.client.HTTPException) as e:
        return {"status": status, "chunks": seen, "error": repr(e)[:200], "closed_at": time.monotonic(),
                "events": events[-3:], "seconds": round(time.monotonic() - t0, 1)}
    finally:
        try:
            import socket
            if conn.sock is not None:
                conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        conn.close()
    out = {"status": status, "chunks": seen, "closed_at": time.monotonic(), "seconds": round(time.monotonic() - t0, 1)}
    if seen < chunks:
        out["events"] = events[-3:]          # why it ended early
    return out


def run_disconnect_storm(base_url: str, model: str, rd: RayDriver, app: str, n: int = 20, chunks: int = 3,
                         max_tokens: int = 1000, seed: int = 0, budget_s: float = 300.0) -> dict:
    """n streams (completions and chat) that each disconnect after `chunks` events; afterwards the
    Router must be back to running = waiting = 0 and kv_usage = 0 within 2 s of the last disconnect."""
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        # no stop ids: a random model that samples one in its first `chunks` tokens would end its stream
        # early (about one run in six with the fault tokens as stops), and the main app injects no faults
        common = dict(max_tokens=max_tokens, ignore_eos=True, stream=True)
        if i % 2:
            jobs.append(("/v1/chat/completions", chat(model, "tell me a long story", **common)))
        else:
            jobs.append(("/v1/completions", completion(model, _ids(rng, 16), **common)))
    before, _ = rd.wait_idle(app, timeout=30)
    with StatsSampler(rd, app) as sampler, cf.ThreadPoolExecutor(n) as pool:
        outs = list(pool.map(lambda j: _stream_then_disconnect(base_url, j[0], j[1], chunks, budget_s), jobs))
    last_close = max(o["closed_at"] for o in outs)
    t_poll = time.monotonic()
    idle_s, last = rd.wait_idle(app, timeout=30)
    drain = None if idle_s is None else t_poll + idle_s - last_close     # from the last disconnect
    mid_stream = sum(1 for o in outs if o["status"] == 200 and o["chunks"] >= chunks)
    return {"streams": n, "mid_stream_disconnects": mid_stream,
            "other": [o for o in outs if not (o["status"] == 200 and o["chunks"] >= chunks)][:5],
            "peak": sampler.peak, "idle_before": before is not None,
            "drain_s": None if drain is None else round(drain, 3), "stats_after": _brief(last),
            "alive_after": is_healthy(base_url, model)[0]}


# ------------------------------------------------------------------------------------------------
# Scenario: an injected fault inside a step
# ------------------------------------------------------------------------------------------------

FAULT_EXPECT = {  # kind -> (token, HTTP status of the poisoned request, error code)
    "exception": (EXCEPTION_TOKEN, 500, "engine_error"),
    "oom": (OOM_TOKEN, 503, "out_of_memory"),
    "sample": (SAMPLE_TOKEN, 500, None),
}


class HealthWatcher:
    """GETs /health every `every` s in the background; records every non-200."""

    def __init__(self, base_url: str, every: float = 0.2):
        self.base_url, self.every = base_url, every
        self.bad: list[str] = []
        self.count = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            r = send(self.base_url, HostileRequest("health", "GET", "/health"), 10)
            self.count += 1
            if r.status != 200:
                self.bad.append(f"{r.status} {r.text[:120] or r.transport_error}")
            self._stop.wait(self.every)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(15)


def _error_of(reply: Reply) -> dict:
    try:
        err = reply.json()["error"]
        return err if isinstance(err, dict) else {}
    except (ValueError, KeyError, TypeError):
        return {}


def _sse_error(reply: Reply) -> Optional[dict]:
    events, _ = sse_events(reply.body)
    for e in events:
        if isinstance(e, dict) and isinstance(e.get("error"), dict):
            return e["error"]
    return None


def run_injected_fault(base_url: str, model: str, rd: RayDriver, app: str, kind: str, bystanders: int = 3,
                       later: int = 3, seed: int = 0, timeout: float = 120.0) -> dict:
    """Bystander streams are running (decoding) when a poisoned request arrives.

    exception/oom: the step that computes the poisoned prompt fails; the poisoned request gets
    500 "engine_error" / 503 + Retry-After "out_of_memory"; the bystanders in that same step either
    finish or end with an SSE error event of the same code and [DONE]; nothing hangs.
    sample: only the poisoned request fails (500); its batch-mates finish normally.
    Always: /health stays 200 throughout, requests after the fault succeed, the KV is freed."""
    token, want_status, want_code = FAULT_EXPECT[kind]
    rng = random.Random(seed)
    problems: list[str] = []
    started = threading.Barrier(bystanders + 1, timeout=timeout)
    results: dict[int, Reply] = {}

    def bystander(i: int):
        body = completion(model, _ids(rng, 8), 200, ignore_eos=True, stop_token_ids=FAULT_TOKENS, stream=True,
                          seed=100 + i)
        u = base_url.rstrip("/") + "/v1/completions"
        _assert_loopback(u)
        t0 = time.monotonic()
        chunks, got_first = [], False
        try:
            with _session().post(u, data=dumps(body), headers=JSON, stream=True, timeout=(5, timeout)) as r:
                headers = {k.lower(): v for k, v in r.headers.items()}
                for line in r.iter_lines():
                    chunks.append(line)
                    if not got_first and line.startswith(b"data:"):
                        got_first = True
                        _barrier_wait(started)
                results[i] = Reply(r.status_code, headers, b"\n".join(chunks), time.monotonic() - t0)
        except requests.RequestException as e:
            _local.session = None
            results[i] = Reply(None, {}, b"\n".join(chunks), time.monotonic() - t0, repr(e)[:200])
        if not got_first:
            _barrier_wait(started)

    with HealthWatcher(base_url) as hw:
        threads = [threading.Thread(target=bystander, args=(i,)) for i in range(bystanders)]
        for t in threads:
            t.start()
        _barrier_wait(started)                         # every bystander is decoding
        poison_ids = [11, 12, token, 13]
        poisoned = post_json(base_url, "/v1/completions",
                             completion(model, poison_ids, 8, stop_token_ids=FAULT_TOKENS), timeout)
        poisoned_stream = post_json(base_url, "/v1/completions",
                                    completion(model, [14, token, 15], 8, stream=True, stop_token_ids=FAULT_TOKENS),
                                    timeout)
        for t in threads:
            t.join(timeout)
        after = [post_json(base_url, "/v1/completions",
                           completion(model, _ids(rng, 6), 8, stop_token_ids=FAULT_TOKENS), timeout)
                 for _ in range(later)]
    # the poisoned requests
    for label, reply in (("poisoned", poisoned), ("poisoned stream", poisoned_stream)):
        if reply.status is None:
            problems.append(f"{label}: no response ({reply.transport_error})")
            continue
        leak = leaks(reply.text)
        if leak:
            problems.append(f"{label}: leaked internals {leak}: {reply.text[:200]!r}")
        err = _error_of(reply) if reply.status != 200 else (_sse_error(reply) or {})
        status = reply.status
        if status == 200 and err:
            status = want_status                   # failed after the stream began: the SSE error event
            if not sse_events(reply.body)[1]:
                problems.append(f"{label}: SSE error event not followed by [DONE]")
        if status != want_status:
            problems.append(f"{label}: status {reply.status} (want {want_status}): {reply.text[:200]!r}")
        if want_code and err.get("code") != want_code:
            problems.append(f"{label}: error code {err.get('code')!r} (want {want_code!r}): {reply.text[:200]!r}")
        if reply.status == 503 and not _retry_after_ok(reply.headers):
            problems.append(f"{label}: 503 without Retry-After")
        if reply.status == 500:
            rid = reply.headers.get("x-request-id")
            if not rid or rid not in reply.text:
                problems.append(f"{label}: 500 that does not name its x-request-id ({rid})")
        if reply.status != 200:
            problems += [f"{label}: {p}" for p in check_error_body(reply)]
    # the bystanders
    ok = failed_clean = 0
    for i in range(bystanders):
        r = results.get(i)
        if r is None or r.status is None:
            problems.append(f"bystander {i}: no response ({None if r is None else r.transport_error})")
            continue
        events, done = sse_events(r.body)
        err = _sse_error(r)
        if r.status == 200 and err is None and done:
            ok += 1
        elif kind != "sample" and r.status == 200 and err is not None and done and err.get("code") == want_code \
                and not leaks(json.dumps(err)):
            failed_clean += 1
        else:
            problems.append(f"bystander {i}: status {r.status}, [DONE]={done}, error={err}: {r.text[-200:]!r}")
    later_ok = sum(1 for r in after if r.status == 200)
    if later_ok != later:
        problems.append(f"requests after the fault: {later_ok}/{later} OK: "
                        f"{[(r.status, r.text[:120]) for r in after if r.status != 200]}")
    if hw.bad:
        problems.append(f"/health not 200 during the fault: {hw.bad[:3]}")
    idle_s, last = rd.wait_idle(app, timeout=5)
    if idle_s is None:
        problems.append(f"KV/running not back to 0 after the fault: {_brief(last)}")
    return {"kind": kind, "poisoned_status": poisoned.status, "poisoned_code": _error_of(poisoned).get("code"),
            "poisoned_stream_status": poisoned_stream.status, "bystanders": bystanders,
            "bystanders_ok": ok, "bystanders_failed_clean": failed_clean, "later_ok": later_ok, "later": later,
            "health_checks": hw.count, "health_bad": len(hw.bad), "idle_after_s": idle_s, "problems": problems}


def _barrier_wait(b: threading.Barrier) -> None:
    try:
        b.wait()
    except threading.BrokenBarrierError:
        pass


# ------------------------------------------------------------------------------------------------
# Scenario: worker kill mid-stream (the long script only; tests/serve covers worker death in CI)
# ------------------------------------------------------------------------------------------------


def run_worker_kill(base_url: str, model: str, rd: RayDriver, app: str, max_model_len: int, streams: int = 4,
                    recover_timeout: float = 240.0) -> dict:
    """Kill the app's TP worker actors while `streams` streams are decoding. Measured: seconds from
    the kill to the first 503 (new requests or /health), how the in-flight streams ended, statuses
    seen during the outage (only 503 + Retry-After is right), seconds until a request succeeds again."""
    started = threading.Barrier(streams + 1, timeout=120)
    ends: dict[int, dict] = {}

    def stream(i: int):
        body = completion(model, [11, 12, 13 + i], min(2000, max_model_len - 8), ignore_eos=True, stream=True,
                          stop_token_ids=FAULT_TOKENS)
        got_first, chunks = False, []
        try:
            _assert_loopback(base_url)
            with requests.post(base_url.rstrip("/") + "/v1/completions", data=dumps(body), headers=JSON,
                               stream=True, timeout=(5, 120)) as r:
                for line in r.iter_lines():
                    chunks.append(line)
                    if not got_first and line.startswith(b"data:"):
                        got_first = True
                        _barrier_wait(started)
            reply = Reply(r.status_code, {}, b"\n".join(chunks), 0)
            err, (_, done) = _sse_error(reply), sse_events(reply.body)
            ends[i] = {"end": time.monotonic(), "error": err, "done": done, "leaks": leaks(reply.text),
                       "status": r.status_code, "started": got_first}
        except requests.RequestException as e:
            ends[i] = {"end": time.monotonic(), "error": {"transport": repr(e)[:150]}, "done": False, "leaks": [],
                       "status": None, "started": got_first}
        if not got_first:
            _barrier_wait(started)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    _barrier_wait(started)
    t_kill = time.monotonic()
    killed = rd.kill_workers(app)
    first_503 = recovered = None
    seen: dict[str, int] = {}
    bad_outage: list[str] = []
    deadline = t_kill + recover_timeout
    i = 0
    while time.monotonic() < deadline:
        i += 1
        if i % 2:
            r = send(base_url, HostileRequest("health", "GET", "/health"), 10)
        else:
            r = post_json(base_url, "/v1/completions", completion(model, [11, 12], 2), 30)
        now = time.monotonic()
        seen[str(r.status)] = seen.get(str(r.status), 0) + 1
        if r.status == 503 and first_503 is None:
            first_503 = now - t_kill
        if r.status not in (200, 503) or (r.status == 503 and not _retry_after_ok(r.headers)):
            bad_outage.append(f"{r.status} {r.text[:150] or r.transport_error}")
        elif r.status is not None and r.status >= 400:
            found = leaks(r.text)
            if found:
                bad_outage.append(f"leak {found}: {r.text[:150]}")
        if r.status == 200 and i % 2 == 0 and first_503 is not None:
            recovered = now - t_kill
            break
        time.sleep(0.05 if first_503 is None else 0.5)
    for t in threads:
        t.join(60)
    stream_end = [round(e["end"] - t_kill, 2) for e in ends.values()]
    return {"workers_killed": killed, "first_503_s": None if first_503 is None else round(first_503, 3),
            "recovered_s": None if recovered is None else round(recovered, 1), "statuses_during": seen,
            "bad_during_outage": bad_outage[:5], "bad_during_outage_count": len(bad_outage), "streams": streams,
            "streams_running_at_kill": sum(1 for e in ends.values() if e["started"] and e["end"] > t_kill),
            "streams_ended_with_error_event": sum(1 for e in ends.values() if e["error"] and e["done"]),
            "streams_ended_by_transport": sum(1 for e in ends.values() if e["error"] and "transport" in e["error"]),
            "streams_leaking": sum(1 for e in ends.values() if e["leaks"]),
            "stream_end_after_kill_s": stream_end}


# ------------------------------------------------------------------------------------------------
# Scenario: soak
# ------------------------------------------------------------------------------------------------


def run_soak(apps: dict[str, tuple[str, str]], rd: RayDriver, minutes: float, concurrency: int = 4,
             sample_every: float = 5.0, seed: int = 0, max_requests: int = 1_000_000) -> dict:
    """Steady load on `apps` ({app: (base_url, model)}) for `minutes`; counts errors and samples the
    RSS and open fds of every serving process (Routers, TP workers, ingresses, the proxy) via psutil.
    The first samples are taken after a warm-up (10% of the time, 10..60 s)."""
    import psutil
    total = minutes * 60.0
    warmup = min(60.0, max(10.0, 0.1 * total))
    procs = {label: psutil.Process(pid) for label, pid in rd.serving_processes(apps).items()}
    samples: dict[str, list[tuple[float, int, int]]] = {k: [] for k in procs}
    stop = threading.Event()
    counts = {"requests": 0, "errors": 0}
    errors: list[str] = []
    lock = threading.Lock()
    t0 = time.monotonic()
    t_end = t0 + warmup + total
    names = sorted(apps)

    def client(k: int):
        rng = random.Random(seed * 1000 + k)
        while not stop.is_set() and time.monotonic() < t_end:
            with lock:
                if counts["requests"] >= max_requests:
                    return
                counts["requests"] += 1
            app = names[rng.randrange(len(names))]
            base, model = apps[app]
            r_kind = rng.randrange(4)
            mt = rng.randint(4, 24)
            common = dict(stop_token_ids=FAULT_TOKENS, ignore_eos=True, seed=rng.randrange(1000))
            if r_kind == 0:
                path, body = "/v1/completions", completion(model, _ids(rng, rng.randint(4, 64)), mt, **common)
            elif r_kind == 1:
                path, body = "/v1/completions", completion(model, "soak " * rng.randint(1, 30), mt, stream=True,
                                                           **common)
            elif r_kind == 2:
                path, body = "/v1/chat/completions", chat(model, "hello " * rng.randint(1, 20), mt, **common)
            else:
                path, body = "/v1/chat/completions", chat(model, "stream", mt, stream=True, n=2, **common)
            reply = post_json(base, path, body, 120)
            what, detail = classify_generation(reply, mt)
            if what != "completed":
                with lock:
                    counts["errors"] += 1
                    if len(errors) < 10:
                        errors.append(f"{app}{path}: {detail}")

    def sampler():
        while not stop.is_set() and time.monotonic() < t_end:
            if time.monotonic() - t0 >= warmup:
                for label, p in procs.items():
                    try:
                        samples[label].append((time.monotonic() - t0, p.memory_info().rss, p.num_fds()))
                    except psutil.Error:
                        samples[label].append((time.monotonic() - t0, -1, -1))
            stop.wait(sample_every)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    st = threading.Thread(target=sampler)
    for t in threads + [st]:
        t.start()
    try:
        for t in threads:
            t.join(t_end - time.monotonic() + 180)
    finally:
        stop.set()
        st.join(30)
    per_proc = {}
    for label, xs in samples.items():
        good = [x for x in xs if x[1] > 0]
        if len(good) < 2 or len(good) < len(xs):
            per_proc[label] = {"error": "process gone or unsampled", "samples": len(xs)}
            continue
        k = max(1, min(3, len(good) // 4))
        rss0 = statistics.median(x[1] for x in good[:k])
        rss1 = statistics.median(x[1] for x in good[-k:])
        fd0 = statistics.median(x[2] for x in good[:k])
        fd1 = statistics.median(x[2] for x in good[-k:])
        per_proc[label] = {"rss_start_mb": round(rss0 / 2**20, 1), "rss_end_mb": round(rss1 / 2**20, 1),
                           "rss_growth": round((rss1 - rss0) / rss0, 4), "fds_start": fd0, "fds_end": fd1,
                           "samples": len(good)}
    growth = [v["rss_growth"] for v in per_proc.values() if "rss_growth" in v]
    fd_growth = [v["fds_end"] - v["fds_start"] for v in per_proc.values() if "fds_end" in v]
    return {"minutes": minutes, "warmup_s": warmup, "concurrency": concurrency, **counts, "error_examples": errors,
            "processes": per_proc, "max_rss_growth": max(growth) if growth else None,
            "max_fd_growth": max(fd_growth) if fd_growth else None,
            "all_processes_sampled": all("rss_growth" in v for v in per_proc.values()) and bool(per_proc)}


