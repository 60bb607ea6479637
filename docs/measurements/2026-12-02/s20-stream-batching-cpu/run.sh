cd /work/main; export PATH=$PWD/.venv/bin:$PATH GLM_RAY_LOG_STATS_INTERVAL_S=5
for rep in 1 2; do for iv in 0 50; do
  glm-ray serve tiny --max-num-seqs 64 --stream-batching-interval-ms $iv --port 8300 --metrics-port 8301 > /tmp/sb/serve_${iv}_$rep.log 2>&1 &
  server=$!
  for i in $(seq 1 150); do curl -sf 127.0.0.1:8300/v1/models > /dev/null && break; sleep 2; done
  glm-ray bench --base-url http://127.0.0.1:8300 --dataset-name random --random-input-len 128 --random-output-len 64 \
     --random-range-ratio 1 --max-concurrency 32 --tag iv=$iv --output-file /tmp/sb/b_${iv}_$rep.jsonl --no-progress > /tmp/sb/b_${iv}_$rep.txt 2>&1
  kill $server; wait $server 2>/dev/null; ray stop --force > /dev/null 2>&1; sleep 2
done; done
echo done > /tmp/sb/finished
