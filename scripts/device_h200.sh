#!/usr/bin/env bash
# The H200 run for the Serve issue: engine on GPU, orchestration overhead (TP 1/2), the served app
# answering (TP 1 and 2), a short serving benchmark. Results under $OUT. Needs Ray on PYTHONPATH.
set -uo pipefail
source "$(dirname "$0")/device_common.sh"
NGPU=$(nvidia-smi -L | wc -l)
nvidia-smi -L | tee $OUT/gpus.txt
# 1. engine correctness on GPU (pytest if present, else the same checks inline)
if python3 -c "import pytest" 2>/dev/null; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -5 | tee $OUT/gpu_tests.txt
fi
# 2. orchestration overhead: in-process vs Ray compiled graph vs plain actor calls
TPS="1"; [ "$NGPU" -ge 2 ] && TPS="1 2"
timeout 400 python3 -m glm_ray.bench.orchestration /tmp/tiny16 --tp $TPS --modes local compiled actor \
   --batch 8 --steps 64 --device cuda --dtype bfloat16 --json $OUT/orchestration.jsonl 2>&1 \
   | grep -E "^tp=|Error|error" | tee $OUT/orchestration.txt
# 3. the served app answers (TP 1, then TP 2), greedy outputs compared, short bench
for TP in $TPS; do
  PORT=$((8000 + TP))
  timeout 300 python3 -m glm_ray.cli serve /tmp/tiny16 --device cuda --dtype float32 --tp $TP --port $PORT \
     --metrics-port $((9000 + TP)) > $OUT/serve_tp$TP.log 2>&1 &
  SERVER=$!
  for i in $(seq 1 60); do curl -sf 127.0.0.1:$PORT/v1/models >/dev/null && break; grep -q "Traceback" $OUT/serve_tp$TP.log && break; sleep 2; done
  curl -s 127.0.0.1:$PORT/v1/completions -H 'content-type: application/json' \
     -d '{"model":"tiny16","prompt":[11,12,13,14,15,16,17,18,19,20],"max_tokens":32,"temperature":0,"logprobs":1,"ignore_eos":true}' \
     > $OUT/greedy_tp$TP.json
  python3 -m glm_ray.bench.cli --base-url http://127.0.0.1:$PORT --input-len 256 --output-len 64 --range-ratio 1 \
     --concurrency 1 8 --num-prompts 16 --label tp=$TP --result-file $OUT/bench_tp$TP.jsonl 2>&1 | tail -12 > $OUT/bench_tp$TP.txt
  python3 - <<PY >> $OUT/router_stats.txt 2>&1
import ray, json
from ray import serve
ray.init(address="auto")
h = serve.get_deployment_handle("Router", app_name="glm-ray")
print("TP=$TP", json.dumps(h.stats.remote().result()))
PY
  kill $SERVER 2>/dev/null; sleep 3; ray stop --force >/dev/null 2>&1; sleep 2   # by PID (see ab_fp8_proj.sh)
done
python3 - <<'PY' | tee $OUT/tp_compare.txt
import json, os
outs = {tp: json.load(open(f"{os.environ.get('OUT','/tmp/out')}/greedy_tp{tp}.json")) for tp in (1, 2)
        if os.path.exists(f"{os.environ.get('OUT','/tmp/out')}/greedy_tp{tp}.json")}
for tp, o in outs.items():
    print("TP", tp, o.get("choices", [{}])[0].get("logprobs", {}).get("tokens", o)[:12])
if len(outs) == 2:
    a, b = (outs[t]["choices"][0]["logprobs"] for t in (1, 2))
    print("same tokens:", a["tokens"] == b["tokens"],
          "max |dlogprob|:", max(abs(x - y) for x, y in zip(a["token_logprobs"], b["token_logprobs"])))
PY
ls -la $OUT
