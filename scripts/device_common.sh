#!/usr/bin/env bash
# Sourced by the scripts/device_h200*.sh passes: environment, $OUT, and the 16-indexer-head tiny model.
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} PATH=/tmp/site/bin:$PATH RAY_AUTH_MODE=disabled \
       NCCL_NVLS_ENABLE=0 GLM_RAY_CACHE=/tmp/glmcache TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 - <<'PY' 2>&1 | tail -1
from glm_ray.model.tiny import write_tiny, bundled_config
c = bundled_config(); c["index_n_heads"] = 16
write_tiny("/tmp/tiny16", c); print("tiny16 written")
PY
