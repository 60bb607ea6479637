"""scripts/trace_steps.py on a synthetic Chrome trace (the shape torch.profiler exports): per step, the GPU's
idle gaps between kernels and the host ops that ran during each, so a stretch in one step's start shows apart
from one in every step."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "trace_steps.py"


def _x(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}


def test_gaps_per_step_name_the_host_ops_during_them(tmp_path):
    ev = [_x("user_annotation", "glm_ray_bench_step", 0, 10_000),             # step 0: 0..10 ms
          _x("cpu_op", "aten::to", 900, 400),                                  # begun before the gap: 0.2 ms in it
          _x("kernel", "gemm_a", 100, 1_000),
          _x("cpu_op", "aten::index", 1_200, 2_000),                           # the host busy 1.2..3.2 ms
          _x("cpu_op", "aten::nonzero", 1_300, 500),
          _x("kernel", "gemm_b", 3_500, 1_000),                                # 2.4 ms gap before it
          _x("kernel", "gemm_c", 4_520, 1_000),                                # a 20 us gap: below --min-us
          _x("user_annotation", "glm_ray_bench_step", 20_000, 5_000),          # step 1: no gap
          _x("kernel", "gemm_a", 20_100, 1_000),
          _x("kernel", "gemm_b", 21_110, 1_000)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    out = subprocess.run([sys.executable, str(SCRIPT), str(path), "--min-us", "50"], check=True,
                         capture_output=True, text=True).stdout.splitlines()
    assert out[0].startswith("step 0: wall 10.00 ms") and "gpu busy 3.00 ms" in out[0]
    assert "gaps >= 50 us: 1 = 2.40 ms" in out[0]
    assert out[1].split() == ["2.40", "ms", "before", "gemm_b:", "aten::index", "2.00,", "aten::nonzero", "0.50,",
                              "aten::to", "0.20"]
    assert out[2].startswith("step 1: wall 5.00 ms") and "gaps >= 50 us: 0 = 0.00 ms" in out[2]
    assert len(out) == 3
