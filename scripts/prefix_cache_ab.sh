#!/usr/bin/env bash
# Prefix caching on vs off, served (issue #22 measure): `glm-ray serve` the model twice (cache on, then
# --no-enable-prefix-caching), `glm-ray bench` sglang's generated-shared-prefix workload against each, then
# the TTFT / throughput ratio. Defaults: the tiny model on CPU, 8 groups x 1024-token prefix x 8 questions of
# 32 tokens, output 16, C=4. On the H200: MODEL=<dir> EXTRA="--load-format dummy --device cuda"
# GSP="--gsp-num-groups 32 --gsp-prompts-per-group 16 --gsp-system-prompt-len 2048 --gsp-question-len 128
# --gsp-output-len 128" C=16.
#   bash scripts/prefix_cache_ab.sh        (results under ${OUT:-results/prefix-cache})
set -uo pipefail
OUT=${OUT:-results/prefix-cache}; mkdir -p $OUT; PORT=${PORT:-8100}; C=${C:-4}
MODEL=${MODEL:-tiny}; EXTRA=${EXTRA:-}
GSP=${GSP:---gsp-num-groups 8 --gsp-prompts-per-group 8 --gsp-system-prompt-len 1024 --gsp-question-len 32 --gsp-output-len 16}
for mode in on off; do
  flag=""; [ $mode = off ] && flag=--no-enable-prefix-caching
  glm-ray serve $MODEL $EXTRA $flag --port $PORT --metrics-port $((PORT + 1)) > $OUT/serve_$mode.log 2>&1 &
  server=$!
  for i in $(seq 1 150); do curl -sf 127.0.0.1:$PORT/v1/models > /dev/null && break; sleep 2; done
  glm-ray bench --base-url http://127.0.0.1:$PORT --dataset-name generated-shared-prefix $GSP \
     --max-concurrency $C --tag prefix_cache=$mode --output-file $OUT/gsp_$mode.jsonl --no-progress > $OUT/bench_$mode.txt 2>&1
  python3 - "$PORT" > $OUT/stats_$mode.json <<'PY'
import json, sys, ray
from ray import serve
ray.init(address="auto", logging_level="ERROR")
print(json.dumps(serve.get_deployment_handle("Router", app_name="glm-ray").stats.remote().result().get("prefix_cache")))
PY
  kill $server; wait $server 2>/dev/null; ray stop --force > /dev/null 2>&1; sleep 2
done
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
r = {m: json.loads(open(f"{out}/gsp_{m}.jsonl").read().splitlines()[-1]) for m in ("on", "off")}
st = json.loads(open(f"{out}/stats_on.json").read() or "null") or {}
hit = st.get("hits", 0) / max(st.get("queries", 1), 1)
print(f"prefix cache hit rate (on): {hit:.3f}  ({st})")
for k in ("mean_ttft_ms", "median_ttft_ms", "mean_e2e_latency_ms", "output_throughput", "request_throughput"):
    a, b = r["on"].get(k), r["off"].get(k)
    if a and b:
        print(f"{k:>22}: on {a:10.2f}  off {b:10.2f}  off/on {b / a:6.2f}")
PY
