"""The start-up kernel warm-up on the GPU (worker/warmup.py): in a fresh process, a workload shaped like
real traffic — a prompt past index_topk, a chunk of it, another request joining while it decodes —
triggers Triton JIT compiles inside its steps without the warm-up and none with it (counted with
kernels/cuda/compile_log.py; each run in its own process, so no kernel is already in memory)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU present")]

CHILD = r"""
import json, sys
from glm_ray import LLM, SamplingParams
from glm_ray.kernels.cuda.compile_log import CompileLog
llm = LLM(sys.argv[1], device="cuda", dtype="bfloat16", kv_cache_memory_bytes=256 << 20, max_num_seqs=8,
          max_model_len=1024, max_num_batched_tokens=64)
eng = llm.engine
greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
with CompileLog() as log:
    eng.add_request("long", [(7 * i) % 900 + 10 for i in range(150)], greedy)   # chunked: 64 + 64 + 22 tokens
    for _ in range(6):
        eng.step()
    eng.add_request("join", [(3 * i) % 900 + 10 for i in range(40)], greedy)    # joins a decoding batch
    while eng.has_unfinished():
        eng.step()
print(json.dumps([c.kernel for c in log.compiles]))
"""


def _compiles(path: str, mode: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True, timeout=600,
                         env={**__import__("os").environ, "GLM_RAY_KERNEL_WARMUP": mode})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_warm_up_moves_the_compiles_to_start_up(oracle_dir):
    cold = _compiles(oracle_dir, "off")
    assert cold, "without the warm-up the workload should compile kernels inside its steps"
    warm = _compiles(oracle_dir, "on")
    assert warm == [], f"compiled inside steps despite the warm-up: {warm}"
