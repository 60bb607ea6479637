#!/usr/bin/env bash
# H200 pass of issue #19's async scheduling: its GPU tests (graph replay == eager, async == sync with
# graphs, one host sync per replayed step), then the in-process A/B of the engine loop on glm5-flash-31b
# block-FP8 dummy weights (sync vs async, interleaved x3, batch 1/8/32/64). One device call (<= 600 s).
set -uo pipefail
source "$(dirname "$0")/device_common.sh"; S=$OUT/summary.txt
TESTS="tests/gpu/test_cuda_graphs.py" PART=tests bash "$(dirname "$0")/device_h200_decode.sh" > /dev/null 2>&1
python3 -c "from pathlib import Path; from glm_ray.bench.decode import model_dir_for; print(model_dir_for('glm5-flash-31b', 'fp8', Path('/tmp/models')))" > /tmp/mdir
echo "== bench.offline sync vs async, $(cat /tmp/mdir)" >> $S
timeout ${AB_LIM:-360} python3 -m glm_ray.bench.offline "$(cat /tmp/mdir)" --load-format dummy --device cuda --dtype bfloat16 \
   --batch 1 8 32 64 --input-len 1024 --output-len 64 --scheduling sync async --repeats 3 \
   --kv-cache-memory-bytes $((24 << 30)) --json $OUT/async_ab.jsonl > $OUT/async_ab.log 2>&1; echo "rc=$?" >> $S
grep -vE "INFO|WARNING|shards" $OUT/async_ab.log | tail -30 >> $S
cat $S
