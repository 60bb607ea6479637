#!/usr/bin/env bash
# GLM-5.3-Flash (glm5_next) on one H200, one device call (no Ray needed):
#   bash scripts/device_h200_glm53.sh
# 1. the GPU test suite (tests/gpu, incl. test_gpu_glm5_next.py: CUDA fp32 == CPU fp32 on a tiny
#    glm5_next checkpoint from our writer; this machine's transformers has no glm5_next);
# 2. offline throughput of glm53-flash-slice-8l (GLM-5.3-Flash layer shapes, 6 KDA + 2 MLA layers,
#    dummy bf16 weights, torch-reference KDA) at batch 1/16/64, input 1024, output 64, with the mHC
#    coefficients as one Triton kernel vs the torch reference (alternating, two runs each).
# OP=kda_decode TESTS="tests/gpu -k 'kda or glm5'" ARMS="triton torch triton torch" picks the kernel
# whose A/B runs and the tests before it (defaults: the mHC kernel, all of tests/gpu).
# KDA=1 instead: the chunked KDA prefill's Triton scan (GLM_RAY_CUDA_KDA_SCAN=triton, opt-in until this runs): its
# GPU tests and glm5_next's with the scan on, `bench.kda` (torch vs Triton scan per layer call), then the offline
# prefill-heavy run of glm53-flash-slice-8l (input 8192, output 16) with the scan on / off, alternating.
set -uo pipefail
source "$(dirname "$0")/device_common.sh"
if [ "${KDA:-0}" = 1 ]; then
  S=$OUT/summary_kda.txt
  GLM_RAY_CUDA_KDA_SCAN=triton timeout 240 python3 -m pytest -q tests/gpu/test_cuda_kernels.py -k kda \
      tests/gpu/test_gpu_glm5_next.py 2>&1 | tail -8 >> $S
  timeout 120 python3 -m glm_ray.bench.kda --tokens 1024 8192 --batch 1 4 --json $OUT/bench_kda.jsonl 2>&1 \
      | grep -vE "INFO|WARNING" | tail -6 >> $S
  for ARM in triton torch triton torch; do
    echo "== offline glm53-flash-slice-8l 8192 in: GLM_RAY_CUDA_KDA_SCAN=$ARM" >> $S
    GLM_RAY_CUDA_KDA_SCAN=$ARM timeout 150 python3 -m glm_ray.bench.offline glm53-flash-slice-8l --load-format dummy \
        --device cuda --dtype bfloat16 --batch 1 4 --input-len 8192 --output-len 16 \
        --json $OUT/offline_glm53_kda_$ARM.jsonl 2>&1 | grep -vE "INFO|WARNING" | tail -3 >> $S
  done
  cat $S; exit 0
fi
S=$OUT/summary_glm53.txt; OP=${OP:-mhc_coefficients}; TESTS=${TESTS:-tests/gpu}
eval timeout 300 python3 -m pytest -q $TESTS 2>&1 | tail -15 | tee $OUT/gpu_tests_h200.txt >> $S
# one Triton kernel (default) vs the torch reference for $OP (GLM_RAY_TORCH_OPS), alternating
for ARM in ${ARMS:-triton torch triton torch}; do
  [ $ARM = torch ] && export GLM_RAY_TORCH_OPS=$OP || unset GLM_RAY_TORCH_OPS
  echo "== $OP: $ARM" >> $S
  timeout 150 python3 -m glm_ray.bench.offline glm53-flash-slice-8l --load-format dummy --device cuda \
      --dtype bfloat16 --batch 1 16 64 --input-len 1024 --output-len 64 \
      --json $OUT/offline_glm53_slice8l_h200_${OP}_$ARM.jsonl 2>&1 | grep -vE "INFO|WARNING" | tail -4 >> $S
done
unset GLM_RAY_TORCH_OPS
nvidia-smi --query-gpu=name,memory.used --format=csv >> $S
cat $S
