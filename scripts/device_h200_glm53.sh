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
set -uo pipefail
source "$(dirname "$0")/device_common.sh"
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
