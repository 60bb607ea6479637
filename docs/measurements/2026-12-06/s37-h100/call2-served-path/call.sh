set -u
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
source .devcarry/one/install.sh > /tmp/install.log 2>&1; tail -1 /tmp/install.log
source scripts/device_common.sh
echo "installed t=$(( $(date +%s) - T0 ))"
MDIR=$(python3 -c "from pathlib import Path; from glm_ray.bench.decode import model_dir_for; print(model_dir_for('glm5-flash-31b', 'fp8', Path('/tmp/models')))")
OUT=$OUT/spab2 MODEL=$MDIR GLMRAY="python3 -m glm_ray.cli" \
  SERVE_FLAGS="--load-format dummy --device cuda --dtype bfloat16 --max-model-len 4096 --kv-cache-memory-gb 24" \
  IN=1024 OUTL=256 CS=64 ORDER="base throughput" timeout $(( 585 - $(date +%s) + T0 )) \
  bash scripts/served_path_ab.sh > $OUT/summary.txt 2>&1
echo "rc=$? t=$(( $(date +%s) - T0 ))" >> $OUT/summary.txt; cat $OUT/summary.txt
grep -hE "Traceback|Error" $OUT/spab2/serve_*.log | head -5
