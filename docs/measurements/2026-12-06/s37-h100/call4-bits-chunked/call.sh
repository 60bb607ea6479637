set -u
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
source .devcarry/one/install.sh > /tmp/install.log 2>&1; tail -1 /tmp/install.log
source scripts/device_common.sh > /dev/null 2>&1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_topk.py tests/gpu/test_cuda_indexer.py -k "bits" > $OUT/gpu_tests.log 2>&1
echo "tests rc=$? t=$(( $(date +%s) - T0 ))"; tail -1 $OUT/gpu_tests.log; grep -E "^FAILED|Error" $OUT/gpu_tests.log | head -10
for cfg in "1024 4" "1024 8" "2048 8" "512 4"; do set -- $cfg
  timeout 60 python3 -m glm_ray.bench.indexer --prefill 1x8192 4x8192 --bits-chunk $1 --bits-warps $2 --json $OUT/bench_indexer.jsonl > $OUT/bench_indexer_$1_$2.log 2>&1
  echo "chunk $1 warps $2 rc=$? t=$(( $(date +%s) - T0 ))"; tail -2 $OUT/bench_indexer_$1_$2.log | cut -c1-40,130-200
done
timeout $(( 570 - $(date +%s) + T0 )) python3 -m glm_ray.bench.prefill glm5-flash-31b --shape 1x8192 4x8192 --quant fp8 --device cuda --modes piecewise --prefill-selection indices bits --profile-top 14 --json $OUT/prefill.jsonl > $OUT/prefill.log 2>&1
echo "prefill rc=$? t=$(( $(date +%s) - T0 ))"
grep -E "^ *glm5" $OUT/prefill.log | tail -8
