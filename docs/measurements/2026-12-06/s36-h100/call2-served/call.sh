set -u
T0=$(date +%s)
source .devcarry/b/install.sh > /tmp/install.log 2>&1; tail -2 /tmp/install.log
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
SERVE_LIM=300 BENCH_LIM=200 OFF_LIM=200 bash scripts/device_h200_served.sh > /dev/null 2>&1
echo "t=$(( $(date +%s) - T0 ))" >> $OUT/summary.txt; cat $OUT/summary.txt
