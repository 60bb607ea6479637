set -u
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
source .devcarry/one/install.sh > /tmp/install.log 2>&1; tail -1 /tmp/install.log
source scripts/device_common.sh
echo "tree: 9f63f89 (session 39 call 1) installed t=$(( $(date +%s) - T0 ))"
MDIR=$(python3 -c "from pathlib import Path; from glm_ray.bench.decode import model_dir_for; print(model_dir_for('glm5-flash-31b', 'fp8', Path('/tmp/models')))")
OUT=$OUT/di MODEL=$MDIR GLMRAY="python3 -m glm_ray.cli" \
  EXTRA="--load-format dummy --device cuda --dtype bfloat16 --max-num-seqs 64 --max-model-len 4096 --kv-cache-memory-gb 24" \
  GSP="--gsp-num-groups 32 --gsp-prompts-per-group 16 --gsp-system-prompt-len 2048 --gsp-question-len 128 --gsp-output-len 128" \
  CS="64 32 16" C=16 PORTS=30000 GLM_RAY_LOG_STATS_INTERVAL_S=5 LIM=$(( 560 - $(date +%s) + T0 )) RUN_S=95 \
  timeout $(( 588 - $(date +%s) + T0 )) bash scripts/direct_ingress_ab.sh > $OUT/summary.txt 2>&1
echo "rc=$? t=$(( $(date +%s) - T0 ))" >> $OUT/summary.txt; cat $OUT/summary.txt
grep -hE "Traceback|Error" $OUT/di/serve_*.log | head -5
ls $OUT/di; du -sh $OUT
