#!/usr/bin/env bash
# H200 decode pass (issue #18): the GPU tests of the decode path, then the committed decode benchmark
# (glm5-flash-31b block-FP8 dummy, TP1, eager vs graphs, batch 1/8/32/64 x context 1k/8k, and glm5-slice-6l).
# One device call (<= 600 s): PART=tests | flash | flashkern | kern | slice | all (default all: tests,
# flash, slice). TESTS=files picks GPU test files. flashkern = flash with both decode-size kernels at 64 (GLM_RAY_CUDA_FP8_SMALL_M=64,
# GLM_RAY_CUDA_MOE_DECODE_PAIRS=64), graphs only; kern = their microbenchmarks (the thresholds' A/B).
set -uo pipefail
source "$(dirname "$0")/device_common.sh"; S=$OUT/summary.txt; PART=${PART:-all}
if [ $PART = all ] || [ $PART = tests ]; then
  echo "== gpu tests (one process per file: a device-side assert cannot hide the other files)" >> $S
  for f in ${TESTS:-tests/gpu/test_*.py}; do
    timeout ${TEST_LIM:-120} python3 -m pytest -q -p no:cacheprovider $f > $OUT/t.log 2>&1
    echo "$(basename $f) rc=$? $(tail -1 $OUT/t.log)" >> $S
    grep -E "^(FAILED|ERROR)" $OUT/t.log | cut -c1-300 >> $S; cat $OUT/t.log >> $OUT/gpu_tests.log
  done; rm -f $OUT/t.log
fi
if [ $PART = all ] || [ $PART = flash ]; then
  echo "== bench.decode glm5-flash-31b fp8" >> $S
  timeout ${FLASH_LIM:-300} python3 -m glm_ray.bench.decode glm5-flash-31b --quant fp8 --device cuda --batch 1 8 32 64 \
     --context 1024 8192 --steps 10 --profile-steps 3 --profile-top 12 --mode ${MODES:-graph eager} \
     --json $OUT/decode_flash31b.jsonl > $OUT/decode_flash31b.log 2>&1; echo "rc=$?" >> $S
  grep -vE "INFO|WARNING|shards" $OUT/decode_flash31b.log | tail -60 >> $S
fi
if [ $PART = flashkern ]; then
  echo "== bench.decode glm5-flash-31b fp8, decode-size kernels on" >> $S
  GLM_RAY_CUDA_FP8_SMALL_M=64 GLM_RAY_CUDA_MOE_DECODE_PAIRS=64 timeout ${FLASH_LIM:-300} python3 -m glm_ray.bench.decode \
     glm5-flash-31b --quant fp8 --device cuda --batch 1 8 32 64 --context 1024 8192 --steps 10 --profile-steps 3 \
     --profile-top 12 --mode graph --json $OUT/decode_flash31b_kern.jsonl > $OUT/decode_flash31b_kern.log 2>&1
  echo "rc=$?" >> $S; grep -vE "INFO|WARNING|shards" $OUT/decode_flash31b_kern.log | tail -60 >> $S
fi
if [ $PART = kern ]; then
  echo "== small-M block-FP8 linear: fused vs act_quant + _scaled_mm vs Triton GEMM" >> $S
  timeout 200 python3 scripts/bench_kernels.py --small-m --out $OUT/small_m.json 2>&1 | tail -50 >> $S
  echo "== decode MoE vs grouped" >> $S
  timeout 200 python3 -m glm_ray.bench.moe_decode --json $OUT/moe_decode.jsonl 2>&1 | tail -40 >> $S
fi
if [ $PART = all ] || [ $PART = slice ]; then
  echo "== bench.decode glm5-slice-6l fp8" >> $S
  timeout ${SLICE_LIM:-150} python3 -m glm_ray.bench.decode glm5-slice-6l --quant fp8 --device cuda --batch 1 8 32 64 \
     --context 1024 8192 --steps 10 --profile-steps 3 --profile-top 8 --mode graph eager \
     --json $OUT/decode_slice6l.jsonl > $OUT/decode_slice6l.log 2>&1; echo "rc=$?" >> $S
  grep -vE "INFO|WARNING|shards" $OUT/decode_slice6l.log | tail -40 >> $S
fi
cat $S
