#!/usr/bin/env bash
# Origin PR B's A/B protocol for the FP8 projection flag, through the served app and `glm-ray bench`:
# random ids, input/output 1024 (override IN/OUT), num-prompts = 4 x C, C = 4..64, 3 repetitions,
# fp8_proj off vs on, dummy bf16 weights of a bundled config. Needs Ray on PYTHONPATH (see
# the GPU machine's Ray-from-wheels recipe: no registry there). Results: $OUT/<model>_tp<TP>_fp8{off,on}.jsonl + the delta table.
#   MODEL=glm5-slice-6l TP=1 bash scripts/ab_fp8_proj.sh        # issue 5 (one H200)
#   MODEL=glm5-flash-31b TP=4 bash scripts/ab_fp8_proj.sh       # issue 9 (nvidia-h200-x4)
# FLAGS="off" / FLAGS="on" runs one half (to split the A/B over two device calls); FLAGS="off on off on"
# interleaves server lifetimes (each leg appends REPS runs to its flag's file: on a host-bound engine the
# spread between two lifetimes was larger than the effect, see docs/measurements/2026-11-30). The compare
# table is written once both result files exist. For the flag's effect on one step without serving noise:
#   python -m glm_ray.bench.fp8_proj_step $MODEL --load-format dummy --device cuda --dtype bfloat16
# SERVE_EXTRA adds serve flags to both legs (e.g. "--throughput-optimized": Serve's proxy out of the stream, whose
# saturation at high C on some hosts (docs/measurements/2026-12-06, s36/s37) is one source of the spread between
# lifetimes); PPC sets the prompts per concurrency (default 4, PR B's; more prompts shrink each mean's noise).
# MIN_TOKENS sets the FP8 gate (default 512). MODEL_DIR serves a model directory in MODEL's place (MODEL still
# names the result files), e.g. a block-FP8 config whose q_b_proj / o_proj stay bf16 (PR B's checkpoints). DEVICE=cpu DTYPE=float32 MODEL=glm5-tiny checks the script here.
set -uo pipefail
MODEL=${MODEL:-glm5-slice-6l}; TP=${TP:-1}; IN=${IN:-1024}; OUT_LEN=${OUT_LEN:-1024}; REPS=${REPS:-3}
CONC=${CONC:-"4 8 16 32 64"}; FLAGS=${FLAGS:-"off on"}; DEVICE=${DEVICE:-cuda}; DTYPE=${DTYPE:-bfloat16}
MAX_SEQS=${MAX_SEQS:-64}; MIN_TOKENS=${MIN_TOKENS:-512}; OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false
SERVER=""; BENCH=""
stop_server() {  # by PID: `pkill -f "glm_ray.cli serve"` also matched any caller holding that text
  [ -n "$BENCH" ] && kill $BENCH 2>/dev/null; BENCH=""
  [ -n "$SERVER" ] && kill $SERVER 2>/dev/null && sleep 5; SERVER=""; ray stop --force >/dev/null 2>&1; sleep 3
}
# an outer `timeout` signals this shell only: without the trap the server (and its Ray cluster and port
# 8000) outlived it, and the next leg's bench talked to a server that was being torn down
trap 'stop_server; exit 124' TERM INT
for FLAG in $FLAGS; do
  EXTRA=""; [ $FLAG = on ] && EXTRA="--fp8-proj-gemm --fp8-proj-min-tokens $MIN_TOKENS"
  LOG=$OUT/serve_${MODEL}_tp${TP}_fp8$FLAG.log
  python3 -m glm_ray.cli serve ${MODEL_DIR:-$MODEL} --load-format dummy --device $DEVICE --dtype $DTYPE --tp $TP \
      --max-num-seqs $MAX_SEQS --max-num-batched-tokens 8192 --port 8000 $EXTRA ${SERVE_EXTRA:-} > $LOG 2>&1 &
  SERVER=$!
  for i in $(seq 1 300); do curl -sf 127.0.0.1:8000/v1/models >/dev/null && break; grep -q Traceback $LOG && break; sleep 2; done
  if ! curl -sf 127.0.0.1:8000/v1/models >/dev/null; then echo "server did not come up:"; tail -30 $LOG; stop_server; exit 1; fi
  grep -E "fp8_proj_gemm|orchestration|KV cache" $LOG | tail -3
  python3 -m glm_ray.bench.cli --base-url http://127.0.0.1:8000 --input-len $IN --output-len $OUT_LEN \
      --range-ratio 1 --prompts-per-concurrency ${PPC:-4} --concurrency $CONC --repetitions $REPS --label fp8_proj=$FLAG --no-plot --no-progress \
      --result-file $OUT/${MODEL}_tp${TP}_fp8$FLAG.jsonl > $OUT/bench_fp8$FLAG.log 2>&1 &
  BENCH=$!; wait $BENCH; RC=$?; BENCH=""  # waited on in the background: a TERM runs the trap at once
  tail -12 $OUT/bench_fp8$FLAG.log
  [ $RC = 0 ] || { echo "bench exited $RC; server log tail:"; tail -20 $LOG; }
  stop_server
done
A=$OUT/${MODEL}_tp${TP}_fp8off.jsonl; B=$OUT/${MODEL}_tp${TP}_fp8on.jsonl
[ -s $A ] && [ -s $B ] || exit 0
python3 -m glm_ray.bench.cli --compare $OUT/${MODEL}_tp${TP}_fp8off.jsonl $OUT/${MODEL}_tp${TP}_fp8on.jsonl \
    | tee $OUT/${MODEL}_tp${TP}_compare.txt
