#!/usr/bin/env bash
# Issue 5's remaining H200 runs, one device call per PART (each fits the 10-minute call limit; after
# the two-call Ray install of the GPU machine's Ray-from-wheels recipe: no registry there, on the same warm machine):
#   PART=step  bash scripts/device_h200_fp8proj.sh   # in-process step A/B, slice-6l + flash-31b (~4 min)
#   PART=legs1 bash scripts/device_h200_fp8proj.sh   # served slice-6l, legs off then on (~8 min)
#   PART=legs2 bash scripts/device_h200_fp8proj.sh   # served slice-6l, legs on then off (~8 min)
#   PART=flash bash scripts/device_h200_fp8proj.sh   # served flash-31b, one rep per leg, on then off (~6 min)
# legs1 + legs2 give 4 reps per flag from two server lifetimes each, in ABBA order; compare locally:
#   python -m glm_ray.bench.cli --compare <off files concatenated> <on files concatenated>
# Issue #20 measure 2 (PR B's protocol, 3 server lifetimes per flag in the order off/on/on/off/off/on, split over
# two device calls of ~6 min each; output PRB_OUT=256 tokens, not PR B's 1024, to fit the device budget):
#   PART=prb1 bash scripts/device_h200_fp8proj.sh   # a discarded warm-up lifetime (PRB_WARM=0: none), lifetimes 1-3: off on on
#   PART=prb2 bash scripts/device_h200_fp8proj.sh   # lifetimes 4-6: off off on (prints the table of all six)
# Each lifetime writes $OUT/prb_<n>_<flag>.jsonl; the table: per C, each lifetime's mean TTFT / ITL, the spread
# between the lifetimes of one flag and the on-vs-off delta of the flags' means (the target: |delta| > spread).
# prb2 reads the first call's files from PRB_PREV (paths in the carried tree, e.g. the committed measurement dir).
# SERVE_EXTRA / PPC pass through to scripts/ab_fp8_proj.sh (e.g. SERVE_EXTRA=--throughput-optimized PPC=8: next try at
# making the served deltas exceed the lifetimes' spread, which session 35's run did not).
# A CPU check of the script: PART=prb1 PRB_MODEL=glm5-tiny DEVICE=cpu DTYPE=float32 CONC=4 PRB_OUT=8 OUT=/tmp/prb
set -uo pipefail
source "$(dirname "$0")/device_common.sh"
PART=${PART:-step}; S=$OUT/summary_$PART.txt
case $PART in
  step)
    for M in glm5-slice-6l glm5-flash-31b; do
      echo "== $M: one prefill step, FP8 projections on vs off (ABBA, 10 iters)" >> $S
      timeout 200 python3 -m glm_ray.bench.fp8_proj_step $M --load-format dummy --device cuda --dtype bfloat16 \
          --tokens 1024 2048 4096 8192 --seq-len 1024 --iters 10 --json $OUT/fp8_proj_step.jsonl 2>&1 \
          | grep -vE "INFO|WARNING" | tail -6 >> $S
    done ;;
  legs1|legs2|flash)
    ORDER="off on"; [ $PART = legs2 ] && ORDER="on off"
    M=glm5-slice-6l; OL=64; R=2; LIM=280
    # flash: one more rep per flag of the flash-31b legs (session 12 ran off/on/on/off, 1 rep each)
    [ $PART = flash ] && { ORDER=${FLASH_ORDER:-"on off"}; M=glm5-flash-31b; OL=32; R=1; LIM=${FLASH_LIM:-260}; }
    for F in $ORDER; do
      OUT=$OUT/$F MODEL=$M TP=1 IN=1024 OUT_LEN=$OL REPS=$R FLAGS=$F timeout $LIM \
          bash scripts/ab_fp8_proj.sh 2>&1 | grep -E "^ +[0-9]|concurrency|rror" >> $S
      cat $OUT/$F/${M}_tp1_fp8$F.jsonl >> $OUT/${PART}_fp8$F.jsonl 2>/dev/null
      tail -c 20000 $OUT/$F/serve_*.log > $OUT/${PART}_serve_fp8$F.log 2>/dev/null; rm -rf $OUT/$F
    done ;;
  prb1|prb2)
    N0=1; ORDER="off on on"; [ $PART = prb2 ] && { N0=4; ORDER="off off on"; }
    # PRB_QUANT=fp8 (default): block-FP8 [128,128] weights with q_b_proj / o_proj left bf16, as in GLM-5's FP8
    # checkpoints (the flag adds an FP8 copy of exactly those two); it also makes glm5-slice-6l fit an 80 GB H100
    # (bf16 experts take ~73 GB). PRB_QUANT=bf16: the bundled config unquantized (sessions 12-21's legs).
    PMODEL=${PRB_MODEL:-glm5-slice-6l}; PDIR=$PMODEL
    [ "${PRB_QUANT:-fp8}" = fp8 ] && PDIR=$(python3 -c "
import json, sys; from pathlib import Path; from glm_ray.bench.decode import model_dir_for
d = model_dir_for(sys.argv[1], 'fp8', Path('/tmp/models/prb')); c = json.loads((d / 'config.json').read_text())
c['quantization_config']['modules_to_not_convert'] = ['self_attn.q_b_proj', 'self_attn.o_proj']
(d / 'config.json').write_text(json.dumps(c, indent=2)); print(d)" $PMODEL)
    echo "== $PART: $PDIR (PRB_QUANT=${PRB_QUANT:-fp8})" >> $S
    export GLM_RAY_LOG_TRITON_COMPILES=${GLM_RAY_LOG_TRITON_COMPILES:-1}
    # PRB_WARM=1 (default, prb1 only): a discarded short lifetime first (C=4, output 16), so lifetime 1 is not the
    # machine's first server (session 35's was an outlier); its Triton compiles are kept in prb_0_warm.log
    if [ $PART = prb1 ] && [ "${PRB_WARM:-1}" = 1 ]; then
      OUT=$OUT/l0 MODEL=$PMODEL MODEL_DIR=$PDIR TP=1 IN=1024 OUT_LEN=16 REPS=1 CONC=4 FLAGS=off timeout 150 \
          bash scripts/ab_fp8_proj.sh > /dev/null 2>&1
      grep -E "triton compile|Router ready" $OUT/l0/serve_*.log | cut -c1-300 | tail -80 > $OUT/prb_0_warm.log 2>/dev/null
      echo "warm-up lifetime: $(grep -c "triton compile" $OUT/prb_0_warm.log) compiles logged" >> $S; rm -rf $OUT/l0
    fi
    n=$N0
    for F in $ORDER; do
      OUT=$OUT/l$n MODEL=$PMODEL MODEL_DIR=$PDIR TP=1 IN=1024 OUT_LEN=${PRB_OUT:-256} REPS=1 FLAGS=$F timeout ${PRB_LIM:-170} \
          bash scripts/ab_fp8_proj.sh 2>&1 | grep -E "^ +[0-9]|concurrency|rror" >> $S
      cp $OUT/l$n/${PMODEL}_tp1_fp8$F.jsonl $OUT/prb_${n}_$F.jsonl 2>/dev/null
      # the Triton compiles of the lifetime (GLM_RAY_LOG_TRITON_COMPILES, exported above): those after "Router ready" ran inside
      # served steps (session 35's first lifetime on a fresh machine was 5x slower at C=4; cause not established)
      { grep -E "triton compile|Router ready" $OUT/l$n/serve_*.log | cut -c1-300 | tail -60; tail -c 8000 $OUT/l$n/serve_*.log; } \
          > $OUT/prb_${n}_serve_$F.log 2>/dev/null; rm -rf $OUT/l$n
      n=$((n + 1))
    done
    python3 -m glm_ray.bench.lifetimes --baseline fp8_proj=off ${PRB_PREV:-} $OUT/prb_*.jsonl >> $S 2>&1 ;;
esac
cat $S
