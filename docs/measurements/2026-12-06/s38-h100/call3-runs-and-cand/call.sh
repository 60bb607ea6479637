set -u
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD:${PYTHONPATH:-} NCCL_NVLS_ENABLE=0 GLM_RAY_CACHE=/tmp/glmcache
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
echo "tree: 2b8eaa1 (session 38 call 3)"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_mla_rows.py tests/gpu/test_cuda_topk.py -k "runs or bits" > $OUT/gpu_tests.log 2>&1
echo "tests rc=$? t=$(( $(date +%s) - T0 ))"; grep -E "passed|failed" $OUT/gpu_tests.log | tail -2; grep -E "^FAILED|^ERROR" $OUT/gpu_tests.log | head -10
timeout 70 python3 -m glm_ray.bench.attention --mode tails --heads 32 --tail-shapes 1x128 2x128 --prefix 2048 --decodes 15 --block-size 64 --iters 20 --json $OUT/tails.jsonl > $OUT/tails.log 2>&1
echo "tails rc=$? t=$(( $(date +%s) - T0 ))"; tail -6 $OUT/tails.log
timeout $(( 285 - $(date +%s) + T0 )) python3 -m glm_ray.bench.indexer --prefill 1x8192 4x8192 --json $OUT/indexer.jsonl > $OUT/indexer.log 2>&1
echo "indexer rc=$? t=$(( $(date +%s) - T0 ))"; tail -4 $OUT/indexer.log
