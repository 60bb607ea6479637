"""The engine-in-rank-0 transport (worker/step_channel.py) with two real gloo ranks on the CPU, no Ray:
rank 0 runs an `EngineCore` over a `BroadcastExecutor`, rank 1 runs `follow`.

- tiny model, TP=2: greedy tokens equal a TP=1 `LLM` run; a request that fails on rank 1 only ends in
  error while the others finish; rank 0 idling longer than its own group timeout does not time the
  follower out; `shutdown` makes `follow` return and the process exit 0.
- a stand-in worker (no model): an empty step, a step larger than the one-broadcast buffer, the stop;
  a follower killed while it waits makes rank 0's next `check_health` raise within the timeout.

Each scenario is one pair of spawned processes (plain `multiprocessing` Processes, not
`torch.multiprocessing.start_processes`, whose join kills the survivors when one rank dies); the
ranks write their results to files. The short rank-0 timeout (`CPU_GROUP_TIMEOUT_S`) is set in the
children before the groups are created.
"""
from __future__ import annotations

import os
import pickle
import signal
import threading
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from glm_ray.distributed import parallel_state
from glm_ray.engine.contract import ModelRunnerOutput, NewRequestData, SchedulerOutput, StepFailure
from glm_ray.engine.sampling_params import SamplingParams
from tests.cluster import free_port

TIMEOUT_S = 5.0            # rank 0's host-group timeout in the children (the production value is 120 s)
PROMPTS = [[11, 250, 37, 901, 64], [500, 12, 77, 3, 480, 91, 200, 15, 610], [42, 42, 7]]
MAX_TOKENS = 5
BAD = "bad"                # the request rank 1 reports as failed




def _child(fn, rank: int, port: int, out_dir: str, *args) -> None:
    """Entry point of a spawned rank: run `fn`, write its result (or the traceback) to a file."""
    torch.set_num_threads(1)
    parallel_state.CPU_GROUP_TIMEOUT_S = TIMEOUT_S
    try:
        res = ("ok", fn(rank, f"tcp://127.0.0.1:{port}", *args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        res = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(res, f)
    if dist.is_initialized():
        # NOTE: left to interpreter exit, torch's gloo teardown aborts at times (exit code -6)
        dist.destroy_process_group()


def _spawn_pair(fn, tmp_path, *args, wait_s: float = 80.0):
    """Run `fn(rank, init_method, *args)` on ranks 0 and 1; return (exit codes, results by rank)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, port, str(tmp_path), *args)) for r in (0, 1)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + wait_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results = {}
    for r in (0, 1):
        path = tmp_path / f"rank{r}.pkl"
        if path.exists():
            results[r] = pickle.loads(path.read_bytes())
    return [p.exitcode for p in procs], results


@pytest.fixture(autouse=True)
def _loopback(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")      # inherited by the spawned ranks


# ---- tiny model, two ranks -----------------------------------------------------------------------
def _run(engine, requests: dict[str, list[int]]) -> dict[str, tuple[list[int], str | None, str | None]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for rid, ids in requests.items():
        engine.add_request(rid, ids, params)
    got = {rid: ([], None, None) for rid in requests}
    while engine.has_unfinished():
        for d in engine.step():
            toks, _, _ = got[d.request_id]
            got[d.request_id] = (toks + d.new_token_ids, d.finish_reason, d.error)
    return got


def _model_rank(rank: int, init_method: str, path: str):
    from glm_ray.config import make_engine_config  # noqa: PLC0415 - imported in the spawned rank
    from glm_ray.engine.engine_core import EngineCore  # noqa: PLC0415
    from glm_ray.worker.step_channel import BroadcastExecutor, StepChannel, follow  # noqa: PLC0415
    from glm_ray.worker.worker import Worker  # noqa: PLC0415

    cfg = make_engine_config(path, tensor_parallel_size=2, device="cpu", dtype="float32",
                             kv_cache_memory_bytes=8 * 2**20, max_num_seqs=8)
    worker = Worker(cfg, rank, init_method=init_method)
    worker.init_device()
    worker.load_model()
    worker.init_cache(worker.determine_num_blocks())      # same budget and shards on both ranks: same count
    channel = StepChannel()
    if rank == 1:
        inner = worker.runner.execute

        def execute(step):                                # fail BAD on this rank only, after the real step
            out = inner(step)
            if any(s.req_id == BAD for s in step.seqs):
                out = ModelRunnerOutput(failed={BAD: StepFailure("error", "injected on rank 1")})
            return out
        worker.runner.execute = execute
        follow(worker, channel)
        return "follower returned"
    ex = BroadcastExecutor(worker, channel)
    engine = EngineCore(cfg, ex, tokenizer=None)
    ex.check_health()
    first = _run(engine, {f"r{i}": p for i, p in enumerate(PROMPTS)})
    second = _run(engine, {"ok0": PROMPTS[0], BAD: PROMPTS[1], "ok1": PROMPTS[2]})
    time.sleep(TIMEOUT_S + 1.0)                            # idle past rank 0's own timeout
    ex.check_health()
    third = _run(engine, {"late": PROMPTS[0]})
    ex.shutdown()
    ex.shutdown()                                          # idempotent
    return first, second, third, ex.num_blocks


def test_tp2_engine_in_rank0(tiny_dir, tmp_path):
    from glm_ray.llm import LLM  # noqa: PLC0415
    llm = LLM(tiny_dir, dtype="float32", device="cpu")
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    ref = {f"r{i}": o.outputs[0].token_ids for i, o in enumerate(outs)}

    codes, results = _spawn_pair(_model_rank, tmp_path, tiny_dir)
    for r in (0, 1):
        assert r in results and results[r][0] == "ok", results.get(r)
    assert codes == [0, 0]
    assert results[1][1] == "follower returned"               # the stop ended `follow`
    first, second, third, num_blocks = results[0][1]
    assert num_blocks > 0
    assert {rid: toks for rid, (toks, _, _) in first.items()} == ref
    assert all(reason == "length" for _, reason, _ in first.values())
    toks, reason, error = second[BAD]
    assert reason == "error" and error == "injected on rank 1" and toks == []
    for rid, prompt in (("ok0", "r0"), ("ok1", "r2")):
        assert second[rid][1] == "length" and second[rid][0] == ref[prompt]
    assert third["late"][0] == ref["r0"]


# ---- async scheduling at TP=2: rank 0 broadcasts the sampled ids --------------------------------
def _run_mixed(engine) -> dict:
    """Greedy, seeded, penalized (its sampling reads the host's outputs) and stop-token requests; the
    outputs by request id."""
    reqs = {
        "greedy": (PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)),
        "seeded": (PROMPTS[1], SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)),
        "penal": (PROMPTS[2], SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=6, ignore_eos=True)),
        "n0": (PROMPTS[1], SamplingParams(temperature=0.8, seed=3, max_tokens=3, ignore_eos=True)),
    }
    for rid, (ids, params) in reqs.items():
        engine.add_request(rid, ids, params)
    got = {rid: ([], None) for rid in reqs}
    while engine.has_unfinished():
        for d in engine.step():
            toks, _ = got[d.request_id]
            got[d.request_id] = (toks + d.new_token_ids, d.finish_reason)
    return got


def _async_rank(rank: int, init_method: str, path: str):
    from glm_ray.config import make_engine_config  # noqa: PLC0415 - imported in the spawned rank
    from glm_ray.engine.engine_core import EngineCore  # noqa: PLC0415
    from glm_ray.worker.step_channel import BroadcastExecutor, StepChannel, follow  # noqa: PLC0415
    from glm_ray.worker.worker import Worker  # noqa: PLC0415

    cfg = make_engine_config(path, tensor_parallel_size=2, device="cpu", dtype="float32",
                             kv_cache_memory_bytes=8 * 2**20, max_num_seqs=8, async_scheduling=True)
    worker = Worker(cfg, rank, init_method=init_method)
    worker.init_device()
    worker.load_model()
    worker.init_cache(worker.determine_num_blocks())
    channel = StepChannel()
    if rank == 1:
        follow(worker, channel)
        return "follower returned"
    ex = BroadcastExecutor(worker, channel)
    engine = EngineCore(cfg, ex, tokenizer=None)
    assert engine.async_scheduling, "TP=2 with the engine beside rank 0 launches steps asynchronously"
    runs = {}
    for mode in ("async", "sync", "async"):
        assert engine.set_async_scheduling(mode == "async") == (mode == "async")
        runs.setdefault(mode, []).append(_run_mixed(engine))
    ex.shutdown()
    return runs


def test_tp2_async_scheduling_equals_sync(tiny_dir, tmp_path):
    """Async scheduling at TP=2 (ranks receive the sampled ids over the TP group) returns exactly what the
    synchronous loop returns: greedy, seeded, penalties, several requests joining and finishing."""
    codes, results = _spawn_pair(_async_rank, tmp_path, tiny_dir, wait_s=120.0)
    for r in (0, 1):
        assert r in results and results[r][0] == "ok", results.get(r)
    assert codes == [0, 0]
    runs = results[0][1]
    sync = runs["sync"][0]
    assert all(len(toks) == {"greedy": 8, "seeded": 8, "penal": 6, "n0": 3}[rid] for rid, (toks, _) in sync.items())
    assert runs["async"][0] == sync and runs["async"][1] == sync


# ---- stand-in worker: the wire, the stop, a killed follower -------------------------------------
class _Recorder:
    """A worker without a model: remembers what it ran; rank 0 "samples" 7 for every sequence, rank 1
    fails "fail-me"."""

    def __init__(self, rank: int):
        self.rank, self.steps = rank, []

    def execute(self, step: SchedulerOutput):
        self.steps.append(step)
        if self.rank == 0:
            return ModelRunnerOutput(sampled={s.req_id: 7 for s in step.seqs})
        failed = {s.req_id: StepFailure("oom", "rank 1") for s in step.seqs if s.req_id == "fail-me"}
        return ModelRunnerOutput(failed=failed) if failed else None

    def launch(self, step: SchedulerOutput):              # rank 0's executor launches, then collects
        return self.execute(step)

    def collect(self, pending):
        return pending


def _big_step() -> SchedulerOutput:
    from glm_ray.engine.contract import ScheduledSeq  # noqa: PLC0415
    ids = list(range(40_000))                              # ~120 KB pickled: past the one-broadcast buffer
    return SchedulerOutput(new_requests=[NewRequestData("long", ids, SamplingParams(max_tokens=1))],
                           seqs=[ScheduledSeq("long", ids[:8], 0, [1, 2], True, True),
                                 ScheduledSeq("fail-me", [5], 3, [], False, True)])


def _recorder_rank(rank: int, init_method: str):
    from glm_ray.worker.step_channel import BUFFER_BYTES, BroadcastExecutor, StepChannel, follow  # noqa: PLC0415

    parallel_state.init_tensor_parallel(rank, 2, init_method, "cpu")
    assert parallel_state.cpu_group() is not None
    channel = StepChannel()
    worker = _Recorder(rank)
    if rank == 1:
        follow(worker, channel)                            # returns at the stop
        got = [(len(s.new_requests[0].prompt_token_ids) if s.new_requests else 0, [q.req_id for q in s.seqs])
               for s in worker.steps]
        # the pre-kill phase: follow again until killed while waiting (a timer; rank 0 then health-checks)
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
        with open(os.path.join(os.environ["STEP_CHANNEL_OUT"], "rank1-steps.pkl"), "wb") as f:
            pickle.dump(got, f)
        follow(worker, StepChannel())
        return "not killed"
    worker.runner = type("R", (), {"num_slots": 64, "block_size": 16})()
    worker.model_cfg = None
    ex = BroadcastExecutor(worker, channel)
    assert ex.num_blocks == 4
    ex.check_health()
    big = _big_step()
    assert len(pickle.dumps(big)) > BUFFER_BYTES
    out = ex.execute(big)
    merged = (out.sampled, {k: (v.kind, v.message) for k, v in out.failed.items()})
    ex.execute(SchedulerOutput(finished_req_ids=["long"]))
    # stop the first `follow`, then talk to the second one until the follower is killed
    ex.channel.send(None)
    ex.check_health()
    time.sleep(2.5)                                        # the follower dies at ~1 s
    t0 = time.monotonic()
    try:
        ex.check_health()
        raised = None
    except Exception as e:  # noqa: BLE001 - what we test
        raised = f"{type(e).__name__}: {e}"
    return merged, raised, time.monotonic() - t0


def test_channel_wire_stop_and_killed_follower(tmp_path, monkeypatch):
    monkeypatch.setenv("STEP_CHANNEL_OUT", str(tmp_path))
    codes, results = _spawn_pair(_recorder_rank, tmp_path, wait_s=60.0)
    assert 0 in results and results[0][0] == "ok", results.get(0)
    # (rank 0 exits non-zero at times: torch tears its gloo group with a dead peer down at exit)
    assert codes[1] == -signal.SIGKILL and 1 not in results
    merged, raised, elapsed = results[0][1]
    sampled, failed = merged
    # rank 0 sampled both; rank 1 failed fail-me: merged in, its sampled token dropped
    assert sampled == {"long": 7} and failed == {"fail-me": ("oom", "rank 1")}
    steps = pickle.loads((tmp_path / "rank1-steps.pkl").read_bytes())
    assert steps == [(0, []), (40_000, ["long", "fail-me"]), (0, [])]
    assert raised is not None and elapsed < TIMEOUT_S, (raised, elapsed)


def test_tp1_has_no_host_group():
    parallel_state.init_tensor_parallel(0, 1, "", "cpu")
    assert parallel_state.cpu_group() is None
