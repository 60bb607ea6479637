set -u
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
source .devcarry/one/install.sh > /tmp/install.log 2>&1; tail -1 /tmp/install.log
source scripts/device_common.sh
echo "tree: 7d9905c (session 40, late-scheduling A/B) installed t=$(( $(date +%s) - T0 ))"
MDIR=$(python3 -c "from pathlib import Path; from glm_ray.bench.decode import model_dir_for; print(model_dir_for('glm5-flash-31b', 'fp8', Path('/tmp/models')))")
OUT=$OUT/di MODEL=$MDIR GLMRAY="python3 -m glm_ray.cli" MODES="on+late on" \
  EXTRA="--load-format dummy --device cuda --dtype bfloat16 --max-num-seqs 64 --max-model-len 4096 --kv-cache-memory-gb 24" \
  GSP="--gsp-num-groups 32 --gsp-prompts-per-group 16 --gsp-system-prompt-len 2048 --gsp-question-len 128 --gsp-output-len 128" \
  CS="32 16" C=16 PORTS=30000 GLM_RAY_LOG_STATS_INTERVAL_S=5 GLM_RAY_STEP_TIMELINE=1 PACK=1 LIM=$(( 565 - $(date +%s) + T0 )) RUN_S=90 \
  timeout $(( 588 - $(date +%s) + T0 )) bash scripts/direct_ingress_ab.sh > $OUT/summary.txt 2>&1
echo "rc=$? t=$(( $(date +%s) - T0 ))" >> $OUT/summary.txt; cat $OUT/summary.txt
cd $OUT/di && tar xzf runs.tgz ./stats_lines_on+late.txt ./stats_lines_on.txt 2>/dev/null; for f in stats_lines_*.txt; do echo "== $f"; grep -v "generation 0.0" $f | sed -E 's/.*(TTFT in the engine [^|]*).*\| (device [^|]*)(\| late.*)?$/\1| \2\3/' | tail -14; done; rm -f stats_lines_*.txt; ls
