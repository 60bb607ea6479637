"""The Router under stress, on the real deployed app "small" (max_num_seqs 1, max_queued_requests 1):
a full queue answers 503 + Retry-After (nothing hangs, nothing admitted is lost); a dead TP worker
makes /health fail, in-flight and new requests get an OpenAI-shaped error, and Serve replaces the
replica (its health check fails), after which the app serves again. Keep the death test last."""
from __future__ import annotations

import concurrent.futures as cf
import json
import time

import requests


def _post(app, max_tokens, stream=False, timeout=120):
    body = {"model": app.model, "prompt": [11, 12, 13, 14, 15], "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream}
    r = requests.post(app.base_url + "/v1/completions", json=body, timeout=timeout)
    return r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.text


def test_full_queue_answers_503_with_retry_after(serve_cluster):
    app = serve_cluster.apps["small"]
    with cf.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: _post(app, 150), range(6)))
    codes = [r[0] for r in results]
    assert 503 in codes and 200 in codes, codes
    for code, headers, text in results:
        if code == 503:
            assert float(headers["retry-after"]) > 0
            err = json.loads(text)["error"]
            assert err["type"] and err["message"]
        else:
            assert code == 200 and json.loads(text)["usage"]["completion_tokens"] == 150
    code, _, text = _post(app, 4)                       # and the server is still serving
    assert code == 200


def test_dead_worker_fails_health_and_replica_is_replaced(serve_cluster):
    import ray
    app = serve_cluster.apps["small"]
    assert requests.get(app.base_url + "/health", timeout=30).status_code == 200
    ray.init(address=serve_cluster.gcs_address, log_to_driver=False)
    try:
        names = [a for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith("glm-ray-worker:small:")]
        assert names, "the Router's TP workers should be named glm-ray-worker:<app>:<replica>:rank<r>"
        for a in names:
            ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]))
        code, _, text = _post(app, 8, timeout=60)       # the step fails -> engine dead -> error, no hang
        assert code >= 500 and "error" in json.loads(text)
        deadline = time.time() + 30
        while requests.get(app.base_url + "/health", timeout=30).status_code == 200:
            assert time.time() < deadline, "/health kept answering 200 with a dead worker"
            time.sleep(1)
        deadline = time.time() + 240                     # Serve: 3 failed health checks, then a new replica
        while True:
            try:
                if requests.get(app.base_url + "/health", timeout=30).status_code == 200 and _post(app, 4)[0] == 200:
                    break
            except requests.RequestException:
                pass
            assert time.time() < deadline, "the replica was not replaced"
            time.sleep(3)
    finally:
        ray.shutdown()


def test_rolling_update_drains_in_flight_stream(serve_cluster):
    """Redeploying "small" (new served name) replaces its replicas; a stream that started before the
    update still receives every token (graceful shutdown drains), and the new version then serves."""
    import copy
    import threading
    app = serve_cluster.apps["small"]
    results = {}

    def stream(i):
        # NOTE: "small" runs one request at a time: the second waits in the old replica's queue, so
        # the update has to drain both a running and a queued request (2 x 1500 tokens: >= 36 s at 12 ms/token; the new version is live after ~22 s).
        body = {"model": app.model, "prompt": [11, 12, 13 + i], "max_tokens": 1500, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        n_chunks, usage = 0, None
        with requests.post(app.base_url + "/v1/completions", json=body, stream=True, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    chunk = json.loads(line[6:])
                    n_chunks += bool(chunk.get("choices"))
                    usage = chunk.get("usage") or usage
        results[i] = dict(status=r.status_code, usage=usage, chunks=n_chunks, end=time.time() - t0)

    t0 = time.time()
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(3)                                      # the stream is running on the old replica
    cfg = copy.deepcopy(serve_cluster.config)
    small = next(a for a in cfg["applications"] if a["name"] == "small")
    small["args"]["served_model_name"] = "glm5-tiny-small-v2"
    serve_cluster.redeploy(cfg)
    deadline = time.time() + 300
    while True:                                        # wait for the new version to answer
        try:
            ids = [m["id"] for m in requests.get(app.base_url + "/v1/models", timeout=10).json()["data"]]
            if ids == ["glm5-tiny-small-v2"]:
                break
        except (requests.RequestException, ValueError, KeyError):
            pass
        assert time.time() < deadline, "the updated app never came up"
        time.sleep(2)
    # either request may be the queued one (arrival order at the replica is not the threads' order)
    switched_while_streaming, t_switch = any(t.is_alive() for t in threads), time.time() - t0
    for t in threads:
        t.join(600)
    for r in results.values():
        assert r["status"] == 200 and r["usage"]["completion_tokens"] == 1500, results
    assert switched_while_streaming, f"the streams ended before the update (switch at {t_switch:.0f}s, {results})"
    print(f"new version live at {t_switch:.0f}s; streams ended at {[round(r['end']) for r in results.values()]}s")
