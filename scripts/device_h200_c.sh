#!/usr/bin/env bash
# Third H200 pass: after the SDPA fix — GPU tests, orchestration overhead, and the full-size
# glm5-flash-31b (dummy bf16 weights) through the offline engine on one GPU.
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
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | grep -E "passed|failed|Error|assert" | head -10 >> $S
echo "== orchestration (tiny, bf16, batch 8, 64 decode steps)" >> $S
timeout 200 python3 -m glm_ray.bench.orchestration /tmp/tiny16 --tp 1 2 --modes local compiled actor \
   --batch 8 --steps 64 --device cuda --dtype bfloat16 --json $OUT/orchestration.jsonl 2>&1 \
   | grep -E "^tp=|Error" >> $S
echo "== glm5-flash-31b dummy bf16, 1 GPU, offline (input 512, output 32)" >> $S
mkdir -p /tmp/flash31b && cp glm_ray/configs/glm5-flash-31b.json /tmp/flash31b/config.json
timeout 240 python3 -m glm_ray.bench.offline /tmp/flash31b --load-format dummy --device cuda --dtype bfloat16 \
   --batch 1 16 64 --input-len 512 --output-len 32 --json $OUT/offline_flash31b.jsonl 2>&1 \
   | grep -vE "INFO|WARNING" | tail -8 >> $S
nvidia-smi --query-gpu=memory.used --format=csv >> $S
cat $S
