# session 43, device call on the same warm H100, tree d388886
source .devcarry/one/install.sh
PART=s43 S43="tests wide" TEST_LIM=70 ATT_LIM=60 bash scripts/device_h200_owed.sh
