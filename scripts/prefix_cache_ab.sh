#!/usr/bin/env bash
# Prefix caching on vs off, served (issue #22 measure): `glm-ray serve` the model twice (cache on, then
# --no-enable-prefix-caching), `glm-ray bench` sglang's generated-shared-prefix workload against each, then
# the TTFT / throughput ratio. Defaults: the tiny model on CPU, 8 groups x 1024-token prefix x 8 questions of
# 32 tokens, output 16, C=4. Each lifetime first runs a discarded 2-group warm-up of the same shape (WARM=0:
# none). On the H200: MODEL=<dir> EXTRA="--load-format dummy --device cuda"
# GSP="--gsp-num-groups 32 --gsp-prompts-per-group 16 --gsp-system-prompt-len 2048 --gsp-question-len 128
# --gsp-output-len 128" C=16. MODES="on" runs one lifetime only.
#   bash scripts/prefix_cache_ab.sh        (results under ${OUT:-results/prefix-cache})
set -uo pipefail
OUT=${OUT:-results/prefix-cache}; mkdir -p $OUT; PORT=${PORT:-8100}; C=${C:-4}
MODEL=${MODEL:-tiny}; EXTRA=${EXTRA:-}; GLMRAY=${GLMRAY:-glm-ray}      # GLMRAY="python3 -m glm_ray.cli" uninstalled
GSP=${GSP:---gsp-num-groups 8 --gsp-prompts-per-group 8 --gsp-system-prompt-len 1024 --gsp-question-len 32 --gsp-output-len 16}
for mode in ${MODES:-on off}; do
  flag=""; [ $mode = off ] && flag=--no-enable-prefix-caching
  $GLMRAY serve $MODEL $EXTRA $flag --port $PORT --metrics-port $((PORT + 1)) > $OUT/serve_$mode.log 2>&1 &
  server=$!
  for i in $(seq 1 150); do curl -sf 127.0.0.1:$PORT/v1/models > /dev/null && break; sleep 2; done
  # warm-up, discarded: the same workload shape with other prefixes (2 groups, another seed), so neither
  # lifetime pays first-use costs (kernel compiles, allocator growth) inside its measured run
  [ "${WARM:-1}" = 1 ] && $GLMRAY bench --base-url http://127.0.0.1:$PORT --dataset-name generated-shared-prefix $GSP \
     --gsp-num-groups 2 --seed 7 --max-concurrency $C --no-progress > $OUT/warmup_$mode.txt 2>&1
  $GLMRAY bench --base-url http://127.0.0.1:$PORT --dataset-name generated-shared-prefix $GSP \
     --max-concurrency $C --tag prefix_cache=$mode --output-file $OUT/gsp_$mode.jsonl --no-progress > $OUT/bench_$mode.txt 2>&1
  sleep 12       # one metrics export interval of Ray's, then the replica's prefix-cache counters
  curl -s 127.0.0.1:$((PORT + 1))/metrics | grep -E '^ray_glm_ray_prefix_cache_(queries|hits)_total' > $OUT/stats_$mode.prom
  # the engine's stats lines: its own TTFT (arrival at the engine -> first token) beside the client's
  grep -o "engine: prompt.*" $OUT/serve_$mode.log | grep -v "generation 0.0 tok/s" | cut -c1-560 > $OUT/stats_lines_$mode.txt
  # the ingress's TTFT split lines: where the time to first token went (ingress, Router, engine)
  grep -o "ingress: TTFT split.*\|router: event-loop lag.*" $OUT/serve_$mode.log | cut -c1-300 > $OUT/ttft_split_$mode.txt
  kill $server; wait $server 2>/dev/null; ray stop --force > /dev/null 2>&1; sleep 2
done
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
r = {m: json.loads(open(f"{out}/gsp_{m}.jsonl").read().splitlines()[-1]) for m in ("on", "off")
     if os.path.exists(f"{out}/gsp_{m}.jsonl")}
if len(r) < 2:           # MODES=on (or off) alone: that lifetime's numbers, no ratio
    for m, row in r.items():
        print(f"cache {m}: hit rate {row.get('prefix_cache_hit_rate') or 0:.3f}, mean TTFT {row['mean_ttft_ms']:.1f} ms, "
              f"median {row['median_ttft_ms']:.1f}, min {row['min_ttft_ms']:.1f}, output {row['output_throughput']:.1f} tok/s")
    sys.exit(0)
def total(name):
    return sum(float(line.rsplit(" ", 1)[1]) for line in open(f"{out}/stats_on.prom") if line.startswith(name))
print(f"prefix cache hit rate (on), usage.cached_tokens: {r['on'].get('prefix_cache_hit_rate') or 0:.3f}  "
      f"({r['on'].get('total_cached_tokens')} cached prompt tokens; off: {r['off'].get('total_cached_tokens')})")
q, h = total("ray_glm_ray_prefix_cache_queries_total"), total("ray_glm_ray_prefix_cache_hits_total")
if q:     # Ray's metrics export (absent where the metrics agent does not run, e.g. the GPU machine)
    print(f"prefix cache hit rate (on), metrics incl. the warm-up: {h / q:.3f}  (hits {h:.0f} / queries {q:.0f})")
for k in ("mean_ttft_ms", "median_ttft_ms", "mean_e2e_latency_ms", "output_throughput", "request_throughput"):
    a, b = r["on"].get(k), r["off"].get(k)
    if a and b:     # latencies: off/on; throughputs: on/off (both > 1 when the cache helps)
        ratio = f"on/off {a / b:6.2f}" if k.endswith("throughput") else f"off/on {b / a:6.2f}"
        print(f"{k:>22}: on {a:10.2f}  off {b:10.2f}  {ratio}")
PY
for mode in ${MODES:-on off}; do
  echo "-- engine stats lines, cache $mode (TTFT in the engine vs the client's above)"
  tail -4 $OUT/stats_lines_$mode.txt
  echo "-- the ingress's TTFT split, cache $mode"
  tail -12 $OUT/ttft_split_$mode.txt
done
