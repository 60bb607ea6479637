set -u
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
source scripts/device_common.sh > /dev/null 2>&1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_topk.py tests/gpu/test_cuda_indexer.py tests/gpu/test_cuda_mla_prefill.py tests/kernels/test_triton_hopper_smem.py > $OUT/gpu_tests.log 2>&1
echo "tests rc=$? t=$(( $(date +%s) - T0 ))"; tail -3 $OUT/gpu_tests.log; grep -E "^FAILED|Error" $OUT/gpu_tests.log | head -10
timeout 90 python3 -m glm_ray.bench.indexer --prefill 8x1024 1x8192 4x8192 --json $OUT/bench_indexer.jsonl > $OUT/bench_indexer.log 2>&1
echo "indexer rc=$? t=$(( $(date +%s) - T0 ))"; tail -6 $OUT/bench_indexer.log
timeout $(( 575 - $(date +%s) + T0 )) python3 -m glm_ray.bench.prefill glm5-flash-31b glm5-slice-6l --shape 1x8192 4x8192 --quant fp8 --device cuda --modes piecewise --prefill-selection indices bits --profile-top 12 --json $OUT/prefill.jsonl > $OUT/prefill.log 2>&1
echo "prefill rc=$? t=$(( $(date +%s) - T0 ))"
grep -E "^ *glm5" $OUT/prefill.log | tail -8
