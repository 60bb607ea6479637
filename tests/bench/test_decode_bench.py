"""`python -m glm_ray.bench.decode` on CPU with the tiny model (rows, floor, and that the fake sequences
really decode at the given context through the runner's diff protocol; the overlapped phase drives the
runner as the async engine does and its id check catches ids read from the wrong step), and the floor's
byte formula on glm5-flash-31b's config against a hand calculation."""
from __future__ import annotations

import json
import math
from importlib import resources

import pytest

from glm_ray.bench import decode
from glm_ray.config import ModelConfig
from glm_ray.worker.model_runner import ModelRunner

BS = 16                                        # default block size


def test_main_decodes_at_the_given_context(tmp_path, monkeypatch, runner_calls):
    monkeypatch.setenv("GLM_RAY_CACHE", str(tmp_path / "cache"))
    seen = runner_calls
    out_json = tmp_path / "rows.jsonl"
    C, steps, warmup, prof = 40, 3, 3, 2
    assert decode.main(["glm5-tiny", "--device", "cpu", "--batch", "1", "2", "--context", str(C), "--steps",
                        str(steps), "--warmup", str(warmup), "--profile-steps", str(prof), "--mode", "eager",
                        "--profile-top", "4", "--json", str(out_json), "--no-overlap"]) == 0

    rows = [json.loads(line) for line in out_json.read_text().splitlines()]
    assert [(r["batch"], r["context"], r["mode"], r["quant"]) for r in rows] == [(1, C, "eager", "fp8"),
                                                                                (2, C, "eager", "fp8")]
    n = warmup + steps + prof                  # decode steps each case ran
    for r in rows:
        assert r["floor_ms"] > 0 and r["step_ms"] > 0 and 0 < r["host_ms"] <= r["step_ms"] + 1e-9
        # the runner's own split of a step: each part inside the step
        split = r["host_split_ms"]
        assert set(split) == {"prepare", "forward", "sample"} and min(split.values()) >= 0
        assert split["forward"] > 0 and max(split.values()) <= r["step_ms"] * 1.05
        assert math.isnan(r["device_ms"]) and r["device_src"] == "none"          # CPU: no device time
        assert r["ratio_wall"] == pytest.approx(r["step_ms"] / r["floor_ms"])
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / r["step_ms"] * 1e3)
        assert 0 < len(r["top_ops"]) <= 4 and r["top_ops_time"] == "cpu"
        assert r["final_pos"] == C - 1 + n
        assert math.isnan(r["overlap_step_ms"]) and r["overlap_tokens_match"] is None    # --no-overlap

    # every fake sequence: registered once with C prompt tokens and ceil(C/bs) blocks, then one token per
    # step at positions C-1, C, ..., each the greedy token of the step before, blocks appended on time
    per_req: dict[str, list] = {}
    finished = set()
    for so, out in seen:
        finished.update(so.finished_req_ids)
        new = {nr.req_id: nr for nr in so.new_requests}
        for s in so.seqs:
            per_req.setdefault(s.req_id, []).append((s, out, new.get(s.req_id)))
    assert len(per_req) == 3 and finished == set(per_req)                       # B=1 + B=2, all finished
    for rid, hist in per_req.items():
        assert [s.start_pos for s, _, _ in hist] == list(range(C - 1, C - 1 + n))
        s0, _, nr = hist[0]
        assert nr is not None and len(nr.prompt_token_ids) == C and s0.token_ids == nr.prompt_token_ids[-1:]
        assert s0.reset_blocks and len(s0.block_ids) == -(-C // BS)
        assert all(nr2 is None and not s.reset_blocks for s, _, nr2 in hist[1:])
        blocks = len(s0.block_ids)
        for (s, _, _), (_, prev_out, _) in zip(hist[1:], hist[:-1]):
            assert s.token_ids == [prev_out.sampled[rid]] and len(s.token_ids) == 1
            blocks += len(s.block_ids)
            assert blocks == s.start_pos // BS + 1                              # the block of this position
        assert all(rid in out.sampled for _, out, _ in hist)


def _run_overlapped(tmp_path, monkeypatch, batches, steps=4, warmup=2) -> tuple[list[dict], list[tuple]]:
    """bench.decode's main with --overlap on the tiny model (no profiling), and every runner launch /
    collect in order: ("launch", SchedulerOutput, PendingStep) and ("collect", PendingStep, output)."""
    monkeypatch.setenv("GLM_RAY_CACHE", str(tmp_path / "cache"))
    events: list[tuple] = []
    launch, collect = ModelRunner.launch, ModelRunner.collect

    def spy_launch(self, step):
        p = launch(self, step)
        events.append(("launch", step, p))
        return p

    def spy_collect(self, pending):
        out = collect(self, pending)
        events.append(("collect", pending, out))
        return out
    monkeypatch.setattr(ModelRunner, "launch", spy_launch)
    monkeypatch.setattr(ModelRunner, "collect", spy_collect)
    out_json = tmp_path / "rows.jsonl"
    assert decode.main(["glm5-tiny", "--device", "cpu", "--batch", *map(str, batches), "--context", "40",
                        "--steps", str(steps), "--warmup", str(warmup), "--profile-steps", "0", "--mode", "eager",
                        "--profile-top", "0", "--json", str(out_json), "--overlap"]) == 0
    return [json.loads(line) for line in out_json.read_text().splitlines()], events


def test_overlap_phase_launches_ahead_with_placeholders(tmp_path, monkeypatch):
    """--overlap: the new columns are finite and > 0, the overlapped ids equal the synchronous phase's, and
    the runner was driven as the async engine drives it: step N+1 launched before step N is collected,
    every decode token after the first the -1 placeholder, positions advancing at launch."""
    C, steps, warmup = 40, 4, 2
    rows, events = _run_overlapped(tmp_path, monkeypatch, [1, 3], steps, warmup)
    assert [r["batch"] for r in rows] == [1, 3]
    n = warmup + steps                                        # overlapped launches per case
    for r in rows:
        for k in ("overlap_step_ms", "overlap_ratio_wall", "overlap_mean_ms", "overlap_tokens_per_s"):
            assert math.isfinite(r[k]) and r[k] > 0, k
        assert r["overlap_ratio_wall"] == pytest.approx(r["overlap_step_ms"] / r["floor_ms"])
        assert r["overlap_tokens_match"] is True and r["overlap_mismatch_step"] is None
        assert r["overlap_steps_checked"] == n
    for B in (1, 3):
        ovl = [e for e in events if e[0] == "launch" and any(f"-b{B}-" in s.req_id and "-overlap-" in s.req_id
                                                              for s in e[1].seqs)]
        assert len(ovl) == n
        pos0 = ovl[0][1].seqs[0].start_pos
        assert pos0 == C - 1 and all(s.token_ids != [-1] for s in ovl[0][1].seqs)     # the prompt's last token
        for i, (_, so, _) in enumerate(ovl):
            assert so.share_tokens and len(so.seqs) == B
            assert all(s.start_pos == pos0 + i for s in so.seqs)
            if i:
                assert all(s.token_ids == [-1] for s in so.seqs)                       # the in-flight token
        # launch i+1 comes before collect i; every launch is collected once, in order
        order = []
        for e in events:
            if e[0] == "launch" and any(e[2] is p for _, _, p in ovl):
                order.append(("L", next(i for i, (_, _, p) in enumerate(ovl) if p is e[2])))
            elif e[0] == "collect" and any(e[1] is p for _, _, p in ovl) and e[2] is not None and e[2].sampled:
                order.append(("C", next(i for i, (_, _, p) in enumerate(ovl) if p is e[1])))
        assert order == [("L", 0)] + [x for i in range(1, n) for x in (("L", i), ("C", i - 1))] + [("C", n - 1)]
        # the ids vary from step to step (on the tiny model's dummy weights), so a wrong step would show
        sampled = [[e[2].sampled[s.req_id] for s in so.seqs] for _, so, p in ovl for e in events
                   if e[0] == "collect" and e[1] is p and e[2] is not None and e[2].sampled]
        assert len(sampled) == n and len({tuple(t) for t in sampled}) > 1


def test_overlap_check_catches_ids_from_the_wrong_step(tmp_path, monkeypatch):
    """A runner that fills a placeholder from the launch before the previous one (a stale token tensor)
    makes the overlapped ids differ from step 1 on: overlap_tokens_match False."""
    stale: list = []
    launch_sample, placeholders = ModelRunner._launch_sample, ModelRunner._placeholders

    def keep(self, *args, **kwargs):
        launch_sample(self, *args, **kwargs)
        stale.append(self._last_tokens)

    def wrong_step(self, seqs, flat):
        if len(stale) < 2:
            return placeholders(self, seqs, flat)
        current, self._last_tokens = self._last_tokens, stale[-2]
        try:
            return placeholders(self, seqs, flat)
        finally:
            self._last_tokens = current
    monkeypatch.setattr(ModelRunner, "_launch_sample", keep)
    monkeypatch.setattr(ModelRunner, "_placeholders", wrong_step)
    rows, _ = _run_overlapped(tmp_path, monkeypatch, [2])
    assert rows[0]["overlap_tokens_match"] is False and rows[0]["overlap_mismatch_step"] == 1


def test_first_mismatch():
    ref = [[1, 2], [3, 4], [5, 6]]
    assert decode.first_mismatch(ref, ref[:2]) is None and decode.first_mismatch(ref, ref) is None
    assert decode.first_mismatch(ref, [[1, 2], [3, 5]]) == 1 and decode.first_mismatch(ref[:1], ref[:2]) == 1


def _flash_31b(quant: bool) -> ModelConfig:
    hf = json.loads(resources.files("glm_ray.configs").joinpath("glm5-flash-31b.json").read_text())
    if quant:
        hf["quantization_config"] = dict(decode.FP8_QUANT_CONFIG)
    return ModelConfig.from_hf(hf)             # bf16 (the config's dtype)


def test_floor_bytes_flash_31b_by_hand():
    """glm5-flash-31b, block FP8: D=2048, 32 heads, r=512, dr=64, dn=192, dv=256, q_lora 768, 47 layers
    (1 dense MLP I=10240, 46 MoE: 64 experts top-4, I=1536, 1 shared), every layer a full indexer (32 x 128,
    topk 2048), vocab 154880. FP8 linear [N, K] = N*K + ceil(N/128)*ceil(K/128)*4 (fp32 block scales)."""
    w = decode.weight_bytes_from_config(_flash_31b(quant=True))
    attn = (2 * 2048 * 2                              # input + post-attention RMSNorm, bf16
            + 768 * 2048 + 6 * 16 * 4                 # q_a_proj      [768, 2048]
            + 768 * 2                                 # q_a_layernorm
            + 8192 * 768 + 64 * 6 * 4                 # q_b_proj      [32*256, 768]
            + 576 * 2048 + 5 * 16 * 4                 # kv_a_proj     [512+64, 2048]
            + 512 * 2                                 # kv_a_layernorm
            + 32 * 192 * 512 * 2 + 32 * 512 * 256 * 2   # absorbed W_UK [32,192,512] + W_UV [32,512,256], bf16
            + 2048 * 8192 + 16 * 64 * 4               # o_proj        [2048, 32*256]
            + 128 * 2048 + 1 * 16 * 4                 # indexer wk    [128, 2048]
            + 2 * 128 * 2)                            # indexer k_norm weight + bias
    assert attn == 40_781_056
    dense_mlp = (2 * 10240 * 2048 + 2 * 80 * 16 * 4) + (2048 * 10240 + 16 * 80 * 4)     # gate_up + down
    expert = (2 * 1536 * 2048 + 2 * 12 * 16 * 4) + (2048 * 1536 + 16 * 12 * 4)           # = one shared expert
    router = 64 * 2048 * 4 + 64 * 4                                                      # fp32 weight + bias
    assert expert == 9_439_488
    assert w.dense == 47 * attn + dense_mlp + 46 * (router + expert) + 2048 * 2 == 2_437_989_120
    assert w.per_expert == expert and w.moe_layers == 46 and (w.num_experts, w.top_k) == (64, 4)
    assert w.indexer_query == 47 * ((4096 * 768 + 32 * 6 * 4) + 32 * 2048 * 4) == 160_206_080   # wq_b + weights_proj
    assert w.lm_head == 154880 * 2048 * 2 == 634_388_480

    cfg = _flash_31b(quant=True)
    # B=8, C=8192 > topk: the indexer scores (query weights read), attention reads topk=2048 latents per
    # sequence and layer, the indexer all 8192 keys
    distinct = 64 * (1 - (1 - 4 / 64) ** 8)                                             # 25.81 of 64 experts
    f = decode.floor_bytes(w, cfg, 8, 8192)
    assert f["kv"] == 47 * 8 * 2048 * 576 * 2 == 887_095_296
    assert f["index_keys"] == 47 * 8 * 8192 * 128 * 2 == 788_529_152
    assert f["weights"] == pytest.approx(2_437_989_120 + 46 * distinct * expert + 160_206_080 + 8 * 2048 * 2)
    assert f["total"] == pytest.approx(f["weights"] + 634_388_480 + 887_095_296 + 788_529_152)
    assert f["total"] / 4.2e12 * 1e3 == pytest.approx(3.837, abs=1e-3)                 # floor ms
    # C=1024 <= topk: no scoring -> no index keys or query weights, every latent read
    f = decode.floor_bytes(w, cfg, 8, 1024)
    assert f["index_keys"] == 0 and f["kv"] == 47 * 8 * 1024 * 576 * 2
    assert f["weights"] == pytest.approx(2_437_989_120 + 46 * distinct * expert + 8 * 2048 * 2)
    # the expected distinct experts: top_k at B=1, all E as B grows
    assert decode.expected_distinct_experts(64, 4, 1) == pytest.approx(4)
    assert decode.expected_distinct_experts(64, 4, 4096) == pytest.approx(64)
    # bf16: 2 bytes per weight, no scales
    wb = decode.weight_bytes_from_config(_flash_31b(quant=False))
    assert wb.per_expert == 3 * 1536 * 2048 * 2 and wb.lm_head == w.lm_head


@pytest.mark.parametrize("quant", ["fp8", "bf16"])
def test_config_bytes_match_the_built_model(tmp_path, monkeypatch, quant):
    """The config formula counts what the model holds (tiny glm5, CPU: fp32 model dtype)."""
    monkeypatch.setenv("GLM_RAY_CACHE", str(tmp_path / "cache"))
    w = decode.build_worker(decode.model_dir_for("glm5-tiny", quant, tmp_path), device="cpu", dtype="auto",
                            mode="eager", max_batch=1, max_context=16, steps_total=2)
    assert decode.weight_bytes_from_config(w.model_cfg) == decode.weight_bytes_from_model(w.model, w.model_cfg)


def test_timeline_splits_a_step_into_host_and_gpu_parts():
    """`_timeline` on synthetic profiler events (us): step [0, 100) with kernels [10, 30) and [40, 60),
    a graph launch of 5 us; step [100, 200) with one kernel [150, 170)."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    from glm_ray.bench import decode as d

    def ev(name, start, end, dev=DeviceType.CPU):
        tr = NS(start=start, end=end, elapsed_us=lambda: end - start)
        return NS(name=name, device_type=dev, time_range=tr)
    events = [ev("glm_ray_bench_step", 0, 100), ev("cudaGraphLaunch", 5, 10), ev("glm_ray_bench_step", 100, 200)]
    kernels = [(10, 30), (40, 60), (150, 170)]
    t = d._timeline(events, kernels)
    # medians over the two steps: busy (40, 20), span (50, 20), gaps (10, 0), before (10, 50), after (40, 30)
    assert t == {"gpu_busy": 0.03, "gpu_span": 0.035, "gpu_gaps": 0.005, "host_before": 0.03, "host_after": 0.035,
                 "graph_launch": 0.0025}


def test_gap_groups_name_the_host_event_inside_each_gap():
    """`bench.gaps.gap_groups` on synthetic events (us), two steps. Step 1 [0, 200): kernels A [10, 30),
    B [80, 90), C [92, 100), D [150, 160); a sync [35, 78) holds the host during the A-B gap (nested in an
    aten::item [33, 79)), the B-C gap (2 us) is below min_us, plain Python (only the step range) during the
    C-D gap. Step 2 [300, 400): A [310, 330), B [380, 390) with a sync [340, 375). The idle time between
    the steps (160 -> 310) is not inside a step range and is not counted."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    from glm_ray.bench.gaps import GapGroup, gap_groups

    def ev(name, start, end, dev=DeviceType.CPU):
        return NS(name=name, device_type=dev, time_range=NS(start=start, end=end))
    K = DeviceType.CUDA
    events = [ev("glm_ray_bench_step", 0, 200), ev("aten::item", 33, 79), ev("cudaStreamSynchronize", 35, 78),
              ev("A", 10, 30, K), ev("B", 80, 90, K), ev("C", 92, 100, K), ev("D", 150, 160, K),
              ev("glm_ray_bench_step", 300, 400), ev("cudaStreamSynchronize", 340, 375),
              ev("A", 310, 330, K), ev("B", 380, 390, K)]
    groups = gap_groups(events, steps=2, min_us=5.0)
    # per step: (50 + 50) / 2 us behind the syncs before B; 50 / 2 us of Python before D
    assert groups == [GapGroup("cudaStreamSynchronize", "B", 1.0, 0.05), GapGroup("glm_ray_bench_step", "D", 0.5, 0.025)]
