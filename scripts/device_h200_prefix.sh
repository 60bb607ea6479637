#!/usr/bin/env bash
# H200 pass of issue #22's measures, one device call (<= 590 s); needs xgrammar importable, and Ray for parts 1-2
# (docs/performance.md, "Reproducing on a GPU machine without a package index"):
#   0. (ENGINE=1) bench.shared_prefix: the same workload inside one engine, cache on vs off in one process, each
#      with cached tails as naive prefill groups and as absorbed decode rows (--absorb 0 256)
#      (the engine's own TTFT, no Ray / HTTP; ENGINE_GROUPS groups, default 32), and scripts/profile_step.py on
#      the mixed step a cached request's tail runs in (15 decodes + one 2048-cached + 128-new request)
#   1. scripts/prefix_cache_ab.sh on glm5-flash-31b FP8 dummy (MODES, default "on"; "on off" for the A/B),
#      sglang's generated-shared-prefix workload of the issue (32 groups x 2048-token prefix x 16 questions of
#      128 tokens, output 128, C=16), with the engine's stats lines and the ingress's TTFT split lines
#   2. bench.affinity: two Router replicas on the one GPU (gpus_per_rank 0.5, 20 GiB KV cache each),
#      prefix_affinity vs power_of_two, one app at a time (four replicas do not fit), the same workload at C=32
# AB=0 / AFF=0 skip a part; AB_EXTRA adds serve flags to the prefix-cache lifetimes. Results: $OUT/summary.txt and $OUT/runs.tgz (the runs' files).
set -uo pipefail
source "$(dirname "$0")/device_common.sh"; S=$OUT/summary.txt
MDIR=$(python3 -c "from pathlib import Path; from glm_ray.bench.decode import model_dir_for; print(model_dir_for('glm5-flash-31b', 'fp8', Path('/tmp/models')))")
GSP="--gsp-num-groups 32 --gsp-prompts-per-group 16 --gsp-system-prompt-len 2048 --gsp-question-len 128 --gsp-output-len 128"
if [ "${ENGINE:-0}" = 1 ]; then
  echo "== bench.shared_prefix (engine only), C=16" >> $S
  timeout ${ENGINE_LIM:-450} python3 -u -m glm_ray.bench.shared_prefix glm5-flash-31b --quant fp8 --device cuda \
    --dtype bfloat16 $GSP --gsp-num-groups ${ENGINE_GROUPS:-32} --concurrency 16 --max-model-len 4096 \
    --kv-cache-memory-gb 24 --warmup-groups 1 --absorb 0 256 --json $OUT/engine_gsp.jsonl > $OUT/engine_gsp.log 2>&1
  grep "^concurrency\|^C=\|identical" $OUT/engine_gsp.log >> $S
  timeout 90 python3 scripts/profile_step.py $MDIR --load-format dummy --batch 15 --prefix 2048 --prefill 128 \
    --joining 1 --kv-cache-gb 8 --rows 30 --cprofile 40 > $OUT/profile_mixed.txt 2>&1
  grep -E "^steps:|launches|Self C" $OUT/profile_mixed.txt | head -5 >> $S
fi
if [ "${AB:-1}" = 1 ]; then
  echo "== prefix cache ${MODES:-on} (prefix_cache_ab.sh)" >> $S
  mkdir -p /tmp/pc
  GLM_RAY_LOG_STATS_INTERVAL_S=5 OUT=/tmp/pc MODES=${MODES:-on} MODEL=$MDIR GLMRAY="python3 -m glm_ray.cli" \
    EXTRA="--load-format dummy --device cuda ${AB_EXTRA:-}" GSP="$GSP" C=16 timeout ${AB_LIM:-230} bash scripts/prefix_cache_ab.sh \
    > $OUT/ab.txt 2>&1; echo "ab rc=$?" >> $OUT/ab.txt
  cat $OUT/ab.txt >> $S
  ray stop --force > /dev/null 2>&1
fi
if [ "${AFF:-1}" = 1 ]; then
  echo "== bench.affinity: 2 replicas on one H200, prefix_affinity vs power_of_two" >> $S
  GLM_RAY_LOG_STATS_INTERVAL_S=5 timeout ${AFF_LIM:-330} python3 -m glm_ray.bench.affinity --app-arg model=$MDIR \
    --app-arg load_format=dummy --app-arg device=cuda --app-arg gpus_per_rank=0.5 --app-arg kv_cache_memory_bytes=20Gi \
    --system-prompt-len 2048 --question-len 128 --output-len 128 --groups 32 --prompts-per-group 16 \
    --max-concurrency ${AFF_C:-32} --num-cpus 16 --hit-source usage --apps-in-turn --warmup-groups 2 --repetitions 1 \
    --workdir /tmp/aff > $OUT/affinity.log 2>&1; echo "affinity rc=$?" >> $S
  grep -A6 "^generated-shared-prefix" $OUT/affinity.log >> $S
  grep -E "Traceback|Error" $OUT/affinity.log | head -10 >> $S
fi
tar czf $OUT/runs.tgz -C /tmp $(ls -d /tmp/pc /tmp/aff 2>/dev/null | xargs -n1 basename) 2>/dev/null
cat $S
