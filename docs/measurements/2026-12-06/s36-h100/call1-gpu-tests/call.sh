set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p /tmp/devcache/extra && cp .devcarry/a/ray.part-* /tmp/devcache/ && cp .devcarry/a/*.whl /tmp/devcache/extra/
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/devcache/extra/xgrammar*.whl /tmp/devcache/extra/apache_tvm_ffi*.whl /tmp/devcache/extra/pydantic*.whl /tmp/devcache/extra/typing_inspection*.whl /tmp/devcache/extra/annotated_types*.whl 2>&1 | tail -2
source scripts/device_common.sh
S=$OUT/summary.txt
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt >> $S
git log --oneline -1 >> $S 2>/dev/null
timeout 420 python3 -m pytest -q -p no:cacheprovider tests/gpu > $OUT/gpu_tests.log 2>&1; echo "tests/gpu rc=$? t=$(el)" >> $S
grep -E "passed|failed|^(FAILED|ERROR)" $OUT/gpu_tests.log | tail -15 >> $S
L=$(( 575 - $(el) ))
if [ $L -gt 30 ]; then
  timeout $(( L < 100 ? L : 100 )) python3 -m glm_ray.bench.kda --tokens 1024 8192 --batch 1 4 --json $OUT/bench_kda.jsonl > $OUT/bench_kda.log 2>&1; echo "bench.kda rc=$? t=$(el)" >> $S
  grep -vE "INFO|WARNING" $OUT/bench_kda.log | tail -12 >> $S
fi
L=$(( 575 - $(el) ))
if [ $L -gt 40 ]; then
  GLM_RAY_CUDA_KDA_SCAN=triton timeout $L python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_glm5_next.py > $OUT/glm5next_triton.log 2>&1; echo "glm5_next with triton scan rc=$? t=$(el)" >> $S
  tail -3 $OUT/glm5next_triton.log >> $S
fi
cat $S
