# session 43, device call 1 (an NVIDIA H100 80GB HBM3; asked for nvidia-h200), tree 92a703f
source .devcarry/one/install.sh
PART=s41 S41="tests fp32 step" TEST_LIM=90 STEP_LIM=200 PIECE_MODELS=glm5-flash-31b PIECE_SHAPES="8x1024 1x8192" \
  bash scripts/device_h200_owed.sh
