#!/usr/bin/env bash
# Second H200 pass: GPU tests, orchestration overhead (TP 1/2, compiled graph vs actor calls), a profile.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} PATH=/tmp/site/bin:$PATH RAY_AUTH_MODE=disabled \
       NCCL_NVLS_ENABLE=0 GLM_RAY_CACHE=/tmp/glmcache TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p $OUT; S=$OUT/summary.txt
python3 - <<'PY' 2>&1 | tail -1
from glm_ray.model.tiny import write_tiny, bundled_config
c = bundled_config(); c["index_n_heads"] = 16
write_tiny("/tmp/tiny16", c); print("tiny16 written")
PY
echo "== gpu tests" >> $S
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | grep -E "passed|failed|Error|assert" | head -20 >> $S
echo "== orchestration (bf16, batch 8, 64 decode steps)" >> $S
timeout 300 python3 -m glm_ray.bench.orchestration /tmp/tiny16 --tp 1 2 --modes local compiled actor \
   --batch 8 --steps 64 --device cuda --dtype bfloat16 --json $OUT/orchestration.jsonl 2>&1 \
   | grep -E "^tp=|Error" >> $S
echo "== profile (bf16, batch 8)" >> $S
timeout 120 python3 scripts/profile_step.py /tmp/tiny16 --device cuda --dtype bfloat16 --batch 8 2>&1 \
   | grep -v "INFO\|shards" | head -60 >> $S
cat $S
