#!/usr/bin/env bash
# Serve's HTTP proxy vs Ray 2.60's direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS=1: the ingress replica serves HTTP
# itself on port 30000; the proxy still serves $PORT), issue #22's shared-prefix workload, prefix cache on and off.
# One server lifetime per cache mode; inside it the same workload with fresh prefixes per run (seed 200 + 100 C + the port's index)
# sent to each port of PORTS in turn, so proxy and direct share a lifetime (server lifetimes differ by more than
# most effects). Each lifetime first runs a discarded 2-group warm-up. Defaults: the tiny model on CPU, 8 groups x
# 1024-token prefix x 8 questions of 32, output 16, C=4. On a GPU: MODEL=<dir> EXTRA="--load-format dummy --device
# cuda" GSP="--gsp-num-groups 32 --gsp-prompts-per-group 16 --gsp-system-prompt-len 2048 --gsp-question-len 128
# --gsp-output-len 128" C=16. LIM (s, default 900) bounds the whole script: a run that would start past LIM - RUN_S
# (default 120) is skipped and said so. DI_ENV="RAY_SERVE_THROUGHPUT_OPTIMIZED=1" serves in Ray Serve's whole
# throughput-optimized mode instead (direct ingress + gRPC between deployments + ...; also on port 30000).
# CS="16 64": several concurrencies, each a run of its own (fresh prefixes) in every lifetime and port.
# MODES: lifetimes in order; "on" / "off" = the prefix cache; a "-late" suffix ("on-late") also sets
#   GLM_RAY_LATE_SCHEDULING=1 (engine/pacing.py), so MODES="on on-late on-late on" A/Bs it over interleaved lifetimes;
#   "-alt" sets it to `alternate`: on and off in turns per engine stats window inside one lifetime (set
#   GLM_RAY_LOG_STATS_INTERVAL_S), and the end of the output compares the two kinds of window.
# PACK=1: at the end, every file but the table's inputs moves into $OUT/runs.tgz (a device call returns 8 files).
#   bash scripts/direct_ingress_ab.sh        (results under ${OUT:-results/direct-ingress})
set -uo pipefail
OUT=${OUT:-results/direct-ingress}; mkdir -p $OUT; PORT=${PORT:-8100}; C=${C:-4}; DI=30000
MODEL=${MODEL:-tiny}; EXTRA=${EXTRA:-}; GLMRAY=${GLMRAY:-glm-ray}; LIM=${LIM:-900}; RUN_S=${RUN_S:-120}
GSP=${GSP:---gsp-num-groups 8 --gsp-prompts-per-group 8 --gsp-system-prompt-len 1024 --gsp-question-len 32 --gsp-output-len 16}
T0=$(date +%s); seen=" "
for m in ${MODES:-on off}; do
  mode=$m; n=2; while [[ "$seen" == *" $mode "* ]]; do mode=$m.$n; n=$((n + 1)); done; seen="$seen$mode "   # on, on.2, ...
  m=${m%-late}; m=${m%-alt}; flag=""; [ $m = off ] && flag=--no-enable-prefix-caching
  late=0; [[ "$mode" == *-late* ]] && late=1; [[ "$mode" == *-alt* ]] && late=alternate
  env ${DI_ENV:-RAY_SERVE_ENABLE_DIRECT_INGRESS=1} GLM_RAY_LATE_SCHEDULING=$late $GLMRAY serve $MODEL $EXTRA $flag --port $PORT --metrics-port $((PORT + 1)) \
    > $OUT/serve_$mode.log 2>&1 &
  server=$!
  for i in $(seq 1 150); do
    curl -sf 127.0.0.1:$PORT/v1/models > /dev/null && curl -sf 127.0.0.1:$DI/v1/models > /dev/null && break; sleep 2
  done
  $GLMRAY bench --base-url http://127.0.0.1:$DI --dataset-name generated-shared-prefix $GSP --gsp-num-groups 2 \
    --seed 7 --max-concurrency $C --no-progress > $OUT/warmup_$mode.txt 2>&1
  for c in ${CS:-$C}; do
    pi=0
    for port in ${PORTS:-$DI $PORT}; do         # fresh prefixes per run; the same prompts per (C, port) in each mode
      pi=$((pi + 1)); seed=$((200 + 100 * c + pi))
      if [ $(( $(date +%s) - T0 )) -gt $(( LIM - RUN_S )) ]; then echo "cache $mode, port $port, C=$c: skipped (time)"; continue; fi
      $GLMRAY bench --base-url http://127.0.0.1:$port --dataset-name generated-shared-prefix $GSP --seed $seed \
        --max-concurrency $c --tag "prefix_cache=$mode,port=$port,C=$c" --output-file $OUT/gsp_${mode}_${port}_c$c.jsonl \
        --no-progress --no-plot > $OUT/bench_${mode}_${port}_c$c.txt 2>&1
    done
  done
  grep -o "ingress: TTFT split.*" $OUT/serve_$mode.log | cut -c1-300 > $OUT/ttft_split_$mode.txt
  grep -o "engine: prompt.*" $OUT/serve_$mode.log | grep -v "generation 0.0 tok/s" | cut -c1-900 > $OUT/stats_lines_$mode.txt
  kill $server; wait $server 2>/dev/null; ray stop --force > /dev/null 2>&1; sleep 2
done
python3 - "$OUT" $DI <<'PY'
import glob, json, os, re, statistics, sys
out, direct = sys.argv[1], sys.argv[2]
rows = {}
for f in sorted(glob.glob(f"{out}/gsp_*_*_c*.jsonl")):
    mode, port, c = os.path.basename(f)[4:-6].split("_")
    rows[mode, port, int(c[1:])] = json.loads(open(f).read().splitlines()[-1])
print(f"{'cache':>5} {'path':>14} {'C':>4} {'hit rate':>8} {'mean TTFT':>10} {'median':>8} {'mean ITL':>9} {'out tok/s':>10}")
for (mode, port, c), r in sorted(rows.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
    path = "direct :" + port if port == direct else "proxy :" + port
    print(f"{mode:>5} {path:>14} {c:4d} {r.get('prefix_cache_hit_rate') or 0:8.3f} {r['mean_ttft_ms']:10.1f} "
          f"{r['median_ttft_ms']:8.1f} {r['mean_itl_ms']:9.2f} {r['output_throughput']:10.1f}")
for port, c in sorted({(p, c) for _, p, c in rows}):
    on, off = rows.get(("on", port, c)), rows.get(("off", port, c))
    if on and off:
        print(f"port {port}, C={c}: mean TTFT off/on {off['mean_ttft_ms'] / on['mean_ttft_ms']:.2f}, "
              f"median off/on {off['median_ttft_ms'] / on['median_ttft_ms']:.2f}")
for f in sorted(glob.glob(f"{out}/stats_lines_*-alt*.txt")):   # the in-lifetime A/B: windows by mode
    by = {}
    for line in open(f):
        m = re.search(r"late scheduling (on|off):", line)
        t = re.search(r"TTFT in the engine ([0-9.]+) ms median", line)
        i = re.search(r"ITL in the engine ([0-9.]+) ms mean", line)
        g = re.search(r"gap [0-9.]+ ms \(mean ([0-9.]+)\)", line)
        if m and t and i:
            by.setdefault(m.group(1), []).append((float(t.group(1)), float(i.group(1)), float(g.group(1)) if g else 0.0))
    for k, win in sorted(by.items()):
        med = [statistics.median(w[j] for w in win) for j in range(3)]
        print(f"{os.path.basename(f)}: late scheduling {k}: {len(win)} windows, median of the windows' TTFT in the "
              f"engine {med[0]:.1f} ms, ITL in the engine {med[1]:.2f} ms, device gap mean {med[2]:.2f} ms")
PY
for mode in $(echo $seen); do echo "-- the ingress's TTFT split, $mode"; tail -6 $OUT/ttft_split_$mode.txt; done
if [ "${PACK:-0}" = 1 ]; then
  (cd $OUT && files=$(find . -maxdepth 1 -type f ! -name runs.tgz ! -name 'gsp_*.jsonl') \
     && [ -n "$files" ] && tar czf runs.tgz $files && rm -f $files)
fi
