# session 43, device call (an NVIDIA H100 80GB HBM3), tree d388886
source .devcarry/one/install.sh
PART=s43 S43="tma" ATT_LIM=75 bash scripts/device_h200_owed.sh
source scripts/device_common.sh; python3 -m pytest -q tests/gpu/test_cuda_routing.py -k fp32_linear_prefill_split
