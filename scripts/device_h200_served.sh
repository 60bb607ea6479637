#!/usr/bin/env bash
# H200 pass of issue #19's measure: served ITL vs the offline decode step at the same batch.
# glm5-flash-31b block-FP8 dummy, TP1, CUDA graphs, served by `glm-ray serve` (engine loop in rank 0's
# actor; SCHED=async|sync) and loaded by `glm-ray bench` (random ids, input 1024, output 256, C = 1/16/64,
# 4 x C prompts each); then `bench.offline` at batch 1/16/64 with the same lengths and scheduling.
# SERVE_EXTRA adds serve flags (e.g. "--stream-batching-interval-ms 50" or "--ingress-replicas 2"), CS the
# concurrencies (default "1 16 64"), PARTS the halves to run (default "served offline": e.g. the offline half in a
# call before Ray is carried, PARTS=served later; the ratio is printed once both files are in $OUT).
# Needs Ray and xgrammar importable (docs/performance.md: "Reproducing on a GPU machine without a package index"). One device call (<= 600 s).
set -uo pipefail
source "$(dirname "$0")/device_common.sh"; S=$OUT/summary.txt; SCHED=${SCHED:-async}; PORT=8000
MDIR=$(python3 -c "from pathlib import Path; from glm_ray.bench.decode import model_dir_for; print(model_dir_for('glm5-flash-31b', 'fp8', Path('/tmp/models')))")
FLAG=""; [ "$SCHED" = async ] && FLAG=--async-scheduling; PARTS=${PARTS:-served offline}
if [[ $PARTS == *served* ]]; then
echo "== served $MDIR ($SCHED)" >> $S
GLM_RAY_LOG_STATS_INTERVAL_S=${STATS_S:-5} timeout ${SERVE_LIM:-420} python3 -m glm_ray.cli serve "$MDIR" --load-format dummy --device cuda --dtype bfloat16 \
   --max-num-seqs 64 --max-model-len 4096 --kv-cache-memory-gb 24 $FLAG ${SERVE_EXTRA:-} --port $PORT > $OUT/serve.log 2>&1 &
SERVER=$!; t0=$(date +%s)
for i in $(seq 1 200); do curl -sf 127.0.0.1:$PORT/v1/models >/dev/null && break; grep -q "Traceback" $OUT/serve.log && break; sleep 2; done
echo "ready after $(( $(date +%s) - t0 )) s" >> $S
timeout ${BENCH_LIM:-200} python3 -m glm_ray.bench.cli --base-url http://127.0.0.1:$PORT --dataset-name random \
   --random-input-len 1024 --random-output-len 256 --random-range-ratio 1 --max-concurrency ${CS:-1 16 64} \
   --tag sched=$SCHED --output-file $OUT/served_$SCHED.jsonl > $OUT/served_$SCHED.txt 2>&1; echo "bench rc=$?" >> $S
grep -vE "INFO|WARNING" $OUT/served_$SCHED.txt | tail -40 >> $S
echo "-- the engine's stats lines while serving (decode / prefill-mixed step medians: engine side of the ITL)" >> $S
grep -o "engine: prompt.*" $OUT/serve.log | grep -v "generation 0.0 tok/s" | cut -c1-560 >> $S
kill $SERVER 2>/dev/null; sleep 3; ray stop --force >/dev/null 2>&1; sleep 2
fi
if [[ $PARTS == *offline* ]]; then
echo "== offline ($SCHED)" >> $S
timeout ${OFF_LIM:-200} python3 -m glm_ray.bench.offline "$MDIR" --load-format dummy --device cuda --dtype bfloat16 \
   --batch ${CS:-1 16 64} --input-len 1024 --output-len 256 --scheduling $SCHED --kv-cache-memory-bytes $((24 << 30)) \
   --json $OUT/offline_$SCHED.jsonl > $OUT/offline_$SCHED.log 2>&1; echo "offline rc=$?" >> $S
grep -vE "INFO|WARNING|shards" $OUT/offline_$SCHED.log | tail -8 >> $S
fi
[ -f $OUT/served_$SCHED.jsonl ] && [ -f $OUT/offline_$SCHED.jsonl ] && \
python3 "$(dirname "$0")/served_ratio.py" $OUT/served_$SCHED.jsonl $OUT/offline_$SCHED.jsonl $OUT/serve.log >> $S 2>&1
cat $S
