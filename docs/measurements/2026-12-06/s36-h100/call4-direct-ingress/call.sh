mkdir -p /tmp/devcache/extra && cp .devcarry/a/ray.part-* /tmp/devcache/ && cp .devcarry/a/*.whl /tmp/devcache/extra/ && ls /tmp/devcache | head; nvidia-smi --query-gpu=name --format=csv,noheader
set -u
T0=$(date +%s)
source .devcarry/b/install.sh > /tmp/install.log 2>&1; tail -1 /tmp/install.log
source scripts/device_common.sh
MDIR=$(python3 -c "from pathlib import Path; from glm_ray.bench.decode import model_dir_for; print(model_dir_for('glm5-flash-31b', 'fp8', Path('/tmp/models')))")
GLM_RAY_LOG_STATS_INTERVAL_S=5 OUT=$OUT/di MODEL=$MDIR GLMRAY="python3 -m glm_ray.cli" EXTRA="--load-format dummy --device cuda" \
  GSP="--gsp-num-groups 32 --gsp-prompts-per-group 16 --gsp-system-prompt-len 2048 --gsp-question-len 128 --gsp-output-len 128" \
  C=16 LIM=$(( 560 - $(date +%s) + T0 )) RUN_S=95 timeout 570 bash scripts/direct_ingress_ab.sh > $OUT/summary.txt 2>&1
echo "rc=$? t=$(( $(date +%s) - T0 ))" >> $OUT/summary.txt; cat $OUT/summary.txt
