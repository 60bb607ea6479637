#!/usr/bin/env bash
# Issue #19's ratio: served mean / median ITL (`glm-ray serve` + `glm-ray bench`, random ids, fixed
# lengths) vs the offline engine's decode step (`bench.offline`) at the same batch, one line per C.
# Defaults: the tiny model on CPU (2 cores: read the ratio, not the times). On a GPU pass e.g.
# MODEL=<dir> SERVE_FLAGS="--load-format dummy --device cuda --dtype bfloat16" IN=1024 OUTL=256 CS="1 16 64"
# (scripts/device_h200_served.sh is that run on the H200).
#   bash scripts/served_vs_offline.sh        (results under ${OUT:-results/served-vs-offline})
set -uo pipefail
OUT=${OUT:-results/served-vs-offline}; mkdir -p $OUT; PORT=${PORT:-8200}
MODEL=${MODEL:-tiny}; SERVE_FLAGS=${SERVE_FLAGS:-}; IN=${IN:-128}; OUTL=${OUTL:-64}; CS=${CS:-1 8}
glm-ray serve $MODEL $SERVE_FLAGS --max-num-seqs 64 --port $PORT --metrics-port $((PORT + 1)) > $OUT/serve.log 2>&1 &
server=$!
for i in $(seq 1 150); do curl -sf 127.0.0.1:$PORT/v1/models > /dev/null && break; sleep 2; done
glm-ray bench --base-url http://127.0.0.1:$PORT --dataset-name random --random-input-len $IN --random-output-len $OUTL \
   --random-range-ratio 1 --max-concurrency $CS --output-file $OUT/served.jsonl --no-progress > $OUT/served.txt 2>&1
kill $server; wait $server 2>/dev/null; ray stop --force > /dev/null 2>&1; sleep 2
python -m glm_ray.bench.offline $MODEL $SERVE_FLAGS --batch $CS --input-len $IN --output-len $OUTL \
   --json $OUT/offline.jsonl > $OUT/offline.txt 2>&1
python3 "$(dirname "$0")/served_ratio.py" $OUT/served.jsonl $OUT/offline.jsonl $OUT/serve.log
