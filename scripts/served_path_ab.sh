#!/usr/bin/env bash
# The path after the engine at high concurrency (issue #19: at C=64 one ingress replica behind Serve's proxy
# saturated on a slow host, session 36): server lifetimes of serving variants in the order given (interleave them:
# lifetimes differ by more than most effects), the same random workload in each, then per lifetime and C the
# client's TTFT / ITL / throughput beside the engine's own ITL (its stats lines, split as scripts/served_ratio.py
# does): served / engine is what the path after the engine adds. Variants:
#   base      one ingress replica, through Serve's proxy (the default deployment)
#   ingress2  --ingress-replicas 2
#   batch50   --stream-batching-interval-ms 50 (Ray Serve LLM's stream batching)
#   direct    RAY_SERVE_ENABLE_DIRECT_INGRESS=1 (Ray 2.60, experimental), the bench at the ingress replica's port 30000
#   throughput  RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (Ray 2.60's bundle: direct ingress, gRPC between deployments, user
#             code on the replica's event loop, request-path log buffering, GC frozen after start), port 30000
# Defaults: the tiny model on CPU, ORDER="base direct direct base", input 128, output 64, C = 16. On a GPU e.g.
# MODEL=<glm5-flash-31b fp8 dummy dir> SERVE_FLAGS="--load-format dummy --device cuda --dtype bfloat16
# --max-model-len 4096 --kv-cache-memory-gb 24" IN=1024 OUTL=256 CS=64 ORDER="base ingress2 direct direct ingress2 base".
# With two variants, `python -m glm_ray.bench.lifetimes` then gives the delta beside the spread between lifetimes.
#   bash scripts/served_path_ab.sh        (results under ${OUT:-results/served-path})
set -uo pipefail
OUT=${OUT:-results/served-path}; mkdir -p $OUT; PORT=${PORT:-8300}; GLMRAY=${GLMRAY:-glm-ray}
MODEL=${MODEL:-tiny}; SERVE_FLAGS=${SERVE_FLAGS:-}; IN=${IN:-128}; OUTL=${OUTL:-64}; CS=${CS:-16}
ORDER=${ORDER:-base direct direct base}; i=0; files=""
NP=""; [ "$(echo $CS | wc -w)" = 1 ] && NP="--num-prompts $((4 * CS))"      # a sweep sends 4 x C prompts per C itself
for v in $ORDER; do
  i=$((i + 1)); flags=""; env=""; port=$PORT
  case $v in
    base) ;;
    ingress2) flags="--ingress-replicas 2" ;;
    batch50) flags="--stream-batching-interval-ms 50" ;;
    direct) env="RAY_SERVE_ENABLE_DIRECT_INGRESS=1"; port=30000 ;;
    throughput) env="RAY_SERVE_THROUGHPUT_OPTIMIZED=1"; port=30000 ;;
    *) echo "unknown variant $v" >&2; exit 2 ;;
  esac
  env $env GLM_RAY_LOG_STATS_INTERVAL_S=${STATS_S:-5} $GLMRAY serve $MODEL $SERVE_FLAGS $flags --max-num-seqs 64 \
    --port $PORT --metrics-port $((PORT + 1)) > $OUT/serve_$i.log 2>&1 &
  server=$!
  for t in $(seq 1 150); do curl -sf 127.0.0.1:$port/v1/models > /dev/null && break; sleep 2; done
  # a discarded warm-up at the first C (first-use costs stay out of the measured run)
  $GLMRAY bench --base-url http://127.0.0.1:$port --dataset-name random --random-input-len $IN --random-output-len 8 \
    --random-range-ratio 1 --max-concurrency ${CS%% *} --num-prompts ${CS%% *} --seed 7 --no-progress --no-plot > /dev/null 2>&1
  $GLMRAY bench --base-url http://127.0.0.1:$port --dataset-name random --random-input-len $IN --random-output-len $OUTL \
    --random-range-ratio 1 --max-concurrency $CS $NP --tag variant=$v --output-file $OUT/l${i}_$v.jsonl --no-progress --no-plot \
    > $OUT/bench_$i.txt 2>&1
  files="$files $OUT/l${i}_$v.jsonl"
  kill $server; wait $server 2>/dev/null; ray stop --force > /dev/null 2>&1; sleep 2
done
python3 - "$OUT" "$(dirname "$0")" <<'PY'
import glob, importlib.util, json, os, sys
out, here = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location("served_ratio", os.path.join(here, "served_ratio.py"))
sr = importlib.util.module_from_spec(spec); spec.loader.exec_module(sr)
print(f"{'lifetime':>12} {'C':>4} {'TTFT':>8} {'ITL mean':>9} {'median':>7} {'out tok/s':>10} {'engine ITL':>11} {'served/engine':>14}")
for f in sorted(glob.glob(f"{out}/l*_*.jsonl"), key=lambda p: int(os.path.basename(p)[1:].split("_")[0])):
    name = os.path.basename(f)[:-6]
    rows = [json.loads(x) for x in open(f)]
    eng = sr.engine_itl_by_concurrency(f"{out}/serve_{name[1:].split('_')[0]}.log", [r["max_concurrency"] for r in rows])
    for r in rows:
        c, e = r["max_concurrency"], eng.get(r["max_concurrency"])
        ratio = f"{r['mean_itl_ms'] / e:14.3f}" if e else f"{'-':>14}"
        print(f"{name:>12} {c:4d} {r['mean_ttft_ms']:8.1f} {r['mean_itl_ms']:9.2f} {r['median_itl_ms']:7.2f} "
              f"{r['output_throughput']:10.1f} {e or float('nan'):11.2f} {ratio}")
PY
[ $(echo $ORDER | tr ' ' '\n' | sort -u | wc -l) = 2 ] && python3 -m glm_ray.bench.lifetimes $files
exit 0
