#!/usr/bin/env bash
# H200 engine pass: GPU tests, orchestration overhead (TP 1/2, compiled graph vs actor calls), the
# full-size glm5-flash-31b (dummy bf16 weights) through the offline engine, and a step profile.
set -uo pipefail
source "$(dirname "$0")/device_common.sh"; S=$OUT/summary.txt
echo "== gpu tests" >> $S
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | grep -E "passed|failed|Error|assert" | head -10 >> $S
echo "== orchestration (tiny, bf16, batch 8, 64 decode steps)" >> $S
timeout 200 python3 -m glm_ray.bench.orchestration /tmp/tiny16 --tp 1 2 --modes local compiled actor \
   --batch 8 --steps 64 --device cuda --dtype bfloat16 --json $OUT/orchestration.jsonl 2>&1 \
   | grep -E "^tp=|Error" >> $S
echo "== glm5-flash-31b dummy bf16, 1 GPU, offline (input 512, output 32)" >> $S
timeout 240 python3 -m glm_ray.bench.offline glm5-flash-31b --load-format dummy --device cuda --dtype bfloat16 \
   --batch 1 16 64 --input-len 512 --output-len 32 --json $OUT/offline_flash31b.jsonl 2>&1 \
   | grep -vE "INFO|WARNING" | tail -8 >> $S
echo "== profile (tiny, bf16, batch 8)" >> $S
timeout 120 python3 scripts/profile_step.py /tmp/tiny16 --device cuda --dtype bfloat16 --batch 8 2>&1 \
   | grep -v "INFO\|shards" | head -60 >> $S
cat $S
