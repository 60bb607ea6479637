set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p /tmp/devcache/extra && cp .devcarry/a/ray.part-* /tmp/devcache/ && cp .devcarry/a/*.whl /tmp/devcache/extra/
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/devcache/extra/xgrammar*.whl /tmp/devcache/extra/apache_tvm_ffi*.whl /tmp/devcache/extra/pydantic*.whl /tmp/devcache/extra/typing_inspection*.whl /tmp/devcache/extra/annotated_types*.whl 2>&1 | tail -2
source scripts/device_common.sh
S=$OUT/summary.txt
nvidia-smi --query-gpu=name --format=csv,noheader >> $S; git log --oneline -1 >> $S 2>/dev/null
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_kernels.py -k kda > $OUT/kda_tests.log 2>&1; echo "kda tests rc=$? t=$(el)" >> $S
tail -2 $OUT/kda_tests.log >> $S
GLM_RAY_CUDA_KDA_SCAN=triton timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_glm5_next.py > $OUT/glm5next_triton.log 2>&1; echo "glm5_next (scan=triton) rc=$? t=$(el)" >> $S
grep -E "passed|failed|fallback|uses the torch" $OUT/glm5next_triton.log | tail -3 >> $S
timeout 120 python3 -m glm_ray.bench.kda --tokens 1024 8192 --batch 1 4 --json $OUT/bench_kda.jsonl > $OUT/bench_kda.log 2>&1; echo "bench.kda rc=$? t=$(el)" >> $S
grep -vE "INFO|WARNING" $OUT/bench_kda.log | tail -12 >> $S
for ARM in triton torch; do
  L=$(( 560 - $(el) )); [ $L -lt 60 ] && break
  echo "== offline glm53-flash-slice-8l 8192 in: GLM_RAY_CUDA_KDA_SCAN=$ARM t=$(el)" >> $S
  GLM_RAY_CUDA_KDA_SCAN=$ARM timeout $(( L < 170 ? L : 170 )) python3 -m glm_ray.bench.offline glm53-flash-slice-8l --load-format dummy \
      --device cuda --dtype bfloat16 --batch 1 4 --input-len 8192 --output-len 16 \
      --json $OUT/offline_glm53_kda_$ARM.jsonl > $OUT/offline_$ARM.log 2>&1; echo "rc=$?" >> $S
  grep -vE "INFO|WARNING" $OUT/offline_$ARM.log | tail -4 >> $S
done
echo "t=$(el)" >> $S; cat $S
