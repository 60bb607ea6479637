set -u
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
source .devcarry/one/install.sh > /tmp/install.log 2>&1; tail -1 /tmp/install.log
source scripts/device_common.sh > /dev/null 2>&1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
git log --oneline 2>/dev/null | head -1
timeout $(( 585 - $(date +%s) + T0 )) python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_engine.py tests/gpu/test_piecewise_graphs.py tests/gpu/test_cuda_graphs.py tests/gpu/test_gpu_prefix_cache.py tests/gpu/test_cuda_mla_prefill.py tests/gpu/test_cuda_indexer.py tests/gpu/test_cuda_topk.py tests/gpu/test_warmup_compiles.py tests/gpu/test_gpu_glm5_next.py > $OUT/gpu_tests.log 2>&1
echo "tests rc=$? t=$(( $(date +%s) - T0 ))"; grep -E "passed|failed" $OUT/gpu_tests.log | tail -2; grep -E "^FAILED|^ERROR" $OUT/gpu_tests.log | head -10
