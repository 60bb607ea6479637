#!/usr/bin/env bash
# The H200 measurements the open issues still owe, in one device call (<= 600 s each PART):
#   PART=tests    GPU tests (TESTS= to choose): rope, MoE alignment, indexer, MLA prefill, decode graphs, piecewise
#                 graphs, GLM-5.3-Flash end to end — all passed at 43c9a3d (session 23) but the removed timing
#                 comparison; name the files of kernels changed since in TESTS
#   PART=prefill  bench.attention --mode prefill: the Triton MLA prefill vs its FLOP floor (#20 measure 1)
#   PART=grammar  bench.structured on glm5-flash-31b FP8 dummy: 0/16/64 constrained of 64 (#21 measure)
#   PART=indexer  bench.indexer --prefill: the prefill indexer (a row per query token) vs the torch reference (#20 item 2)
#   PART=mixed    scripts/profile_step.py on a mixed step (15 decoding + one 2048-cached + 128-new request;
#                 MIXED_BATCH=12 MIXED_JOIN=4: #22's served composition): step times with their host split, top
#                 ops and the Triton compiles inside the profiled steps
#   PART=orch     bench.orchestration, TP1 in-process loop, async, batch 1 and 64: step, device time (CUDA events)
#                 and the device's idle gap between steps (#19's gap < 0.1 ms / orchestration <= 3%); no Ray needed
#   PART=firstuse profile_step.py --log-compiles: a fresh 1024-token prompt joining one decode after start-up
#                 (the kernel warm-up's compiles, then any inside the first request's steps)
#   PART=step     bench.prefill: one prefill step of B fresh L-token prompts vs its FLOP floor, glm5-flash-31b and
#                 glm5-slice-6l FP8 dummy, 1x1k 8x1k 1x8k 4x8k (#20 measure 1)
#   PART=pieces   the piecewise prefill graphs: their GPU test, then bench.prefill eager vs piecewise in one
#                 process (glm5-flash-31b FP8 dummy, ${PIECE_SHAPES:-1x1024 8x1024 1x8192}; #20 measure 1)
#   PART=moe      bench.moe_prefill: a tile sweep of the grouped MoE at 512 / 2048 / 8192 tokens, FP8, both
#                 expert shapes (#20 item 3); pick the best per size class into layout.moe_configs
#   PART=sparse   the sparse MLA prefill's tile walks (bench.attention --sparse-tiles, 1x8k / 4x8k at h = 32 and 64),
#                 the MLA prefill GPU test (every walk), then bench.prefill piecewise at 1x8192 (#20 measure 1)
#   PART=steps    bench.prefill piecewise (8x1024, 1x8192; glm5-flash-31b + glm5-slice-6l; 3 profiled steps each,
#                 their Chrome traces and per-step GPU gaps from scripts/trace_steps.py) and bench.decode graphs
#                 (B = 1 / 64, context 1k / 8k, glm5-flash-31b): the step as a whole after host-side changes
#   PART=s41      session 41's unmeasured work: its GPU tests (the carry written in place: block_fp8_linear out=,
#                 mla_prefill out=, rms_norm in_place; piecewise graphs; prefill MoE; fp32_linear's split path), the
#                 prefill fp32_linear (bench_kernels --prefill-fp32-linear), the MLA prefill kernel's key tiles as TMA
#                 boxes (bench.attention --key-loads pointer tma), the prefill MoE kernels with two CTAs an
#                 SM (bench.moe_prefill --path new, ':r128' configs), bench.prefill piecewise 8x1k / 1x8k with its
#                 device-op table (the memcpy rows and the fp32 SIMT GEMM should be gone; README "Performance")
#                 (S41="tests fp32 attn moe step" by default: name a subset to split it over calls)
#   PART=s43      the wide-decode and fp32-split GPU tests, then the split-count, launch-order, key-load and MoE
#                 persistent A/Bs (session 42's work and session 41's attn / moe; S43= picks)
#   PART=all      tests, prefill, grammar, indexer, mixed, orch, firstuse, step
# Needs xgrammar importable (the engine imports it). The served ones (prefix cache on/off #22, served async #19) need Ray: scripts/prefix_cache_ab.sh and
# scripts/device_h200_served.sh with Ray and xgrammar importable (docs/performance.md, "Reproducing on a GPU machine without a package index").
set -uo pipefail
source "$(dirname "$0")/device_common.sh"; S=$OUT/summary.txt; PART=${PART:-all}
MDIR=$(python3 -c "from pathlib import Path; from glm_ray.bench.decode import model_dir_for; print(model_dir_for('glm5-flash-31b', 'fp8', Path('/tmp/models')))")
if [ $PART = all ] || [ $PART = tests ]; then
  echo "== gpu tests" >> $S
  for f in ${TESTS:-tests/gpu/test_cuda_rope.py tests/gpu/test_cuda_moe_align.py tests/gpu/test_cuda_indexer.py tests/gpu/test_cuda_mla_prefill.py tests/gpu/test_cuda_graphs.py tests/gpu/test_piecewise_graphs.py tests/gpu/test_gpu_glm5_next.py tests/gpu/test_pinned_staging.py}; do
    timeout ${TEST_LIM:-150} python3 -m pytest -q -p no:cacheprovider $f > $OUT/t.log 2>&1; rc=$?
    echo "$(basename $f) rc=$rc $(tail -1 $OUT/t.log)" >> $S
    grep -E "^(FAILED|ERROR|E  )" $OUT/t.log | cut -c1-300 | head -30 >> $S; cat $OUT/t.log >> $OUT/gpu_tests.log
  done; rm -f $OUT/t.log
fi
if [ $PART = all ] || [ $PART = prefill ]; then
  echo "== bench.attention --mode prefill" >> $S
  timeout ${PREFILL_LIM:-200} python3 -m glm_ray.bench.attention --mode prefill --heads 32 64 \
     --json $OUT/prefill_attention.jsonl > $OUT/prefill_attention.log 2>&1; echo "rc=$?" >> $S
  grep -vE "INFO|WARNING" $OUT/prefill_attention.log | tail -40 >> $S
fi
if [ $PART = all ] || [ $PART = grammar ]; then
  echo "== bench.structured glm5-flash-31b fp8 dummy" >> $S
  timeout ${GRAMMAR_LIM:-240} python3 -m glm_ray.bench.structured glm5-flash-31b --load-format dummy --quant fp8 \
     --device cuda --scheduling sync async --json $OUT/structured.jsonl > $OUT/structured.log 2>&1; echo "rc=$?" >> $S
  grep -vE "INFO|WARNING|shards" $OUT/structured.log | tail -20 >> $S
fi
if [ $PART = all ] || [ $PART = indexer ]; then
  echo "== bench.indexer --prefill" >> $S
  timeout ${INDEXER_LIM:-150} python3 -m glm_ray.bench.indexer --prefill 1x1024 8x1024 1x8192 4x8192 \
     --json $OUT/indexer_prefill.jsonl > $OUT/indexer_prefill.log 2>&1; echo "rc=$?" >> $S
  grep -vE "INFO|WARNING" $OUT/indexer_prefill.log | tail -8 >> $S
fi
if [ $PART = all ] || [ $PART = mixed ]; then
  echo "== profile_step.py mixed step (glm5-flash-31b fp8 dummy)" >> $S
    timeout ${MIXED_LIM:-200} python3 scripts/profile_step.py $MDIR --load-format dummy --batch ${MIXED_BATCH:-15} --prefix 2048 \
     --prefill 128 --joining ${MIXED_JOIN:-1} --kv-cache-gb 8 --rows 40 > $OUT/profile_mixed.txt 2>&1; echo "rc=$?" >> $S
  grep -E "^steps:|^  step of|launches|Triton compiles|^ *[0-9?.]+ s  " $OUT/profile_mixed.txt | head -30 >> $S
fi
if [ $PART = all ] || [ $PART = orch ]; then
  echo "== bench.orchestration tp1 local async (glm5-flash-31b fp8 dummy)" >> $S
  for b in ${ORCH_BATCH:-64 1}; do
    timeout ${ORCH_LIM:-100} python3 -m glm_ray.bench.orchestration $MDIR --tp 1 --modes local --batch $b --scheduling async \
       --device cuda --dtype bfloat16 --load-format dummy --json $OUT/orchestration.jsonl > $OUT/orch_$b.log 2>&1
    echo "batch $b rc=$?" >> $S; grep "^tp=" $OUT/orch_$b.log >> $S
  done
fi
if [ $PART = all ] || [ $PART = firstuse ]; then
  echo "== profile_step.py --log-compiles, a fresh 1024-token prompt joining one decode" >> $S
  timeout ${FIRST_LIM:-120} python3 scripts/profile_step.py $MDIR --load-format dummy --batch 1 --prefill 1024 \
     --kv-cache-gb 8 --rows 30 --log-compiles > $OUT/profile_firstuse.txt 2>&1; echo "rc=$?" >> $S
  grep -E "triton compile|warm-up|first joining|^steps:|Triton compiles" $OUT/profile_firstuse.txt | cut -c1-250 | head -40 >> $S
fi
if [ $PART = all ] || [ $PART = step ]; then
  echo "== bench.prefill (prefill step vs its FLOP floor)" >> $S
  timeout ${STEP_LIM:-300} python3 -m glm_ray.bench.prefill glm5-flash-31b glm5-slice-6l --shape 1x1024 8x1024 1x8192 4x8192 \
     --quant fp8 --device cuda --profile-top 12 --json $OUT/prefill_step.jsonl > $OUT/prefill_step.log 2>&1; echo "rc=$?" >> $S
  grep -A 12 "^ *model |" $OUT/prefill_step.log | tail -12 >> $S
fi
if [ $PART = pieces ]; then
  echo "== piecewise graphs: gpu test" >> $S
  timeout ${TEST_LIM:-200} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_piecewise_graphs.py > $OUT/pieces_test.log 2>&1
  echo "rc=$? $(tail -1 $OUT/pieces_test.log)" >> $S
  grep -E "^(FAILED|ERROR|E  )" $OUT/pieces_test.log | cut -c1-300 | head -30 >> $S
  echo "== bench.prefill eager vs piecewise" >> $S
  timeout ${STEP_LIM:-330} python3 -m glm_ray.bench.prefill ${PIECE_MODELS:-glm5-flash-31b} --shape ${PIECE_SHAPES:-1x1024 8x1024 1x8192} \
     --quant fp8 --device cuda --profile-top 12 --modes eager piecewise --piecewise-max-tokens ${PIECE_MAX:-8192} \
     --json $OUT/prefill_pieces.jsonl > $OUT/prefill_pieces.log 2>&1; echo "rc=$?" >> $S
  grep -E "piecewise graphs" $OUT/prefill_pieces.log | cut -c1-300 | head -6 >> $S
  grep -A 12 "^ *model |" $OUT/prefill_pieces.log | tail -12 >> $S
fi
if [ $PART = sparse ]; then
  echo "== bench.attention --mode prefill: sparse tile walks" >> $S
  timeout ${SPARSE_LIM:-200} python3 -m glm_ray.bench.attention --mode prefill --heads 32 64 --prefill-shapes 1x8192 4x8192 \
     --no-reference --sparse-tiles noskip skip \
     --json $OUT/sparse_walks.jsonl > $OUT/sparse_walks.log 2>&1; echo "rc=$?" >> $S
  grep -vE "INFO|WARNING" $OUT/sparse_walks.log | tail -16 >> $S
  echo "== gpu test mla_prefill" >> $S
  timeout ${TEST_LIM:-120} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_mla_prefill.py > $OUT/mla_prefill_test.log 2>&1
  echo "rc=$? $(tail -1 $OUT/mla_prefill_test.log)" >> $S
  grep -E "^(FAILED|ERROR|E  )" $OUT/mla_prefill_test.log | cut -c1-300 | head -20 >> $S
  echo "== bench.prefill piecewise 1x8192" >> $S
  timeout ${STEP_LIM:-240} python3 -m glm_ray.bench.prefill ${PIECE_MODELS:-glm5-flash-31b glm5-slice-6l} --shape ${PIECE_SHAPES:-1x8192} \
     --quant fp8 --device cuda --profile-top 12 --modes piecewise --piecewise-max-tokens ${PIECE_MAX:-8192} \
     --json $OUT/prefill_sparse.jsonl > $OUT/prefill_sparse.log 2>&1; echo "rc=$?" >> $S
  grep -A 16 "^ *model |" $OUT/prefill_sparse.log | grep -vE "INFO|WARNING" | head -40 >> $S
fi
if [ $PART = steps ]; then
  echo "== bench.prefill piecewise" >> $S
  timeout ${STEP_LIM:-230} python3 -m glm_ray.bench.prefill ${PIECE_MODELS:-glm5-flash-31b glm5-slice-6l} \
     --shape ${PIECE_SHAPES:-8x1024 1x8192} --quant fp8 --device cuda --profile-top 14 --modes piecewise \
     --piecewise-max-tokens ${PIECE_MAX:-8192} --profile-steps 3 --trace $OUT/traces \
     --json $OUT/prefill_steps.jsonl > $OUT/prefill_steps.log 2>&1; echo "rc=$?" >> $S
  grep -A 18 "^ *model |" $OUT/prefill_steps.log | grep -vE "INFO|WARNING" | head -80 >> $S
  echo "== per-step GPU gaps (scripts/trace_steps.py)" >> $S
  for f in $OUT/traces/*.json; do echo "-- $(basename $f)"; python3 scripts/trace_steps.py $f --top 6; done >> $S 2>&1
  gzip -q $OUT/traces/*.json
  echo "== bench.decode graphs" >> $S
  timeout ${DECODE_LIM:-160} python3 -m glm_ray.bench.decode glm5-flash-31b --batch 1 64 --context 1024 8192 --mode graph \
     --quant fp8 --device cuda --profile-top 12 --json $OUT/decode_steps.jsonl > $OUT/decode_steps.log 2>&1; echo "rc=$?" >> $S
  grep -vE "INFO|WARNING" $OUT/decode_steps.log | tail -40 >> $S
fi
if [ $PART = moe ]; then
  echo "== bench.moe_prefill tile sweep" >> $S
  timeout ${MOE_LIM:-500} python3 -m glm_ray.bench.moe_prefill --geo flash glm5 --mode fp8 --tokens 512 2048 8192 \
     --configs default ${MOE_CONFIGS:-64:128:128:128:8:8:3 64:128:128:128:8:4:4 128:128:128:128:8:8:3 128:128:128:128:8:8:2 32:128:128:128:4:4:4 64:128:64:128:8:4:3} \
     --json $OUT/moe_prefill.jsonl > $OUT/moe_prefill.log 2>&1; echo "rc=$?" >> $S
  grep -A 200 "^$" $OUT/moe_prefill.log | grep -E "^ *(flash|glm5) " | cut -c1-160 >> $S
fi
if [ $PART = s41 ]; then
  s41() { [[ " ${S41:-tests fp32 attn moe step} " == *" $1 "* ]]; }  # S41= picks steps, to split the part over calls
  s41 tests && echo "== gpu tests (session 41)" >> $S
  # S41_TESTS: test files, FILE%EXPR runs `pytest FILE -k EXPR`
  s41 tests && for f in ${S41_TESTS:-tests/gpu/test_cuda_norm.py tests/gpu/test_cuda_kernels.py%into_out \
           tests/gpu/test_cuda_mla_prefill.py tests/gpu/test_piecewise_graphs.py tests/gpu/test_cuda_moe_prefill.py \
           tests/gpu/test_cuda_routing.py}; do
    k=(); [[ $f == *%* ]] && k=(-k "${f#*%}") && f=${f%%%*}
    timeout ${TEST_LIM:-150} python3 -m pytest -q -p no:cacheprovider $f "${k[@]}" > $OUT/t.log 2>&1; rc=$?
    echo "$f rc=$rc $(tail -1 $OUT/t.log)" >> $S
    grep -E "^(FAILED|ERROR|E  )" $OUT/t.log | cut -c1-300 | head -30 >> $S; cat $OUT/t.log >> $OUT/gpu_tests.log
  done; rm -f $OUT/t.log
  if s41 fp32; then
  echo "== bench_kernels --prefill-fp32-linear (split-weight tensor-core kernel vs cuBLAS fp32)" >> $S
  timeout ${K_LIM:-90} python3 scripts/bench_kernels.py --prefill-fp32-linear --out $OUT/fp32_linear.json \
     > $OUT/fp32_linear.log 2>&1; echo "rc=$?" >> $S; grep "^prefill" $OUT/fp32_linear.log >> $S
  fi
  if s41 attn; then
  echo "== bench.attention --mode prefill: key tiles as pointer tiles vs TMA boxes" >> $S
  timeout ${ATT_LIM:-200} python3 -m glm_ray.bench.attention --mode prefill --heads 32 64 \
     --prefill-shapes 8x1024 1x8192 --no-reference --key-loads pointer tma --json $OUT/attn_tma.jsonl \
     > $OUT/attn_tma.log 2>&1; echo "rc=$?" >> $S; grep -vE "INFO|WARNING" $OUT/attn_tma.log | tail -14 >> $S
  echo "== the same at 64 x 64 tiles, 4 warps (sm_90a compile: 168 bytes of spill with TMA boxes vs 2.4 KB)" >> $S
  timeout ${ATT_LIM:-120} python3 -m glm_ray.bench.attention --mode prefill --heads 32 --prefill-shapes 8x1024 1x8192 \
     --no-reference --key-loads pointer tma --config 64 64 4 2 --json $OUT/attn_tma.jsonl \
     > $OUT/attn_tma64.log 2>&1; echo "rc=$?" >> $S; grep -vE "INFO|WARNING" $OUT/attn_tma64.log | tail -8 >> $S
  echo "== 64 x 64 tiles, 8 warps (sm_90a compile, TMA boxes: 145 registers, no spill; pointer tiles 255 + 304 B)" >> $S
  timeout ${ATT_LIM:-120} python3 -m glm_ray.bench.attention --mode prefill --heads 32 --prefill-shapes 8x1024 1x8192 \
     --no-reference --key-loads pointer tma --config 64 64 8 2 --json $OUT/attn_tma.jsonl \
     > $OUT/attn_tma64w8.log 2>&1; echo "rc=$?" >> $S; grep -vE "INFO|WARNING" $OUT/attn_tma64w8.log | tail -8 >> $S
  fi
  if s41 moe; then
  echo "== bench.moe_prefill new kernels: one vs two CTAs an SM, persistent (:p1)" >> $S
  timeout ${MOE_LIM:-200} python3 -m glm_ray.bench.moe_prefill --geo flash glm5 --mode fp8 --tokens 2048 8192 --path new \
     --new-configs default ${MOE_NEW_CONFIGS:-64:256:128:128:8:8:2:tma 64:256:128:128:8:8:2:tma:r128 64:256:128:128:8:8:3:tma:r128 64:256:128:128:8:8:3:tma:p1 64:256:128:128:8:8:2:tma:p1} \
     --stages --json $OUT/moe_new.jsonl > $OUT/moe_new.log 2>&1; echo "rc=$?" >> $S
  grep -E "^ *(flash|glm5) " $OUT/moe_new.log | cut -c1-250 >> $S
  fi
  if s41 step; then
  echo "== bench.prefill piecewise" >> $S
  timeout ${STEP_LIM:-240} python3 -m glm_ray.bench.prefill ${PIECE_MODELS:-glm5-flash-31b glm5-slice-6l} \
     --shape ${PIECE_SHAPES:-8x1024 1x8192} --quant fp8 --device cuda --profile-top 14 --modes piecewise \
     --piecewise-max-tokens ${PIECE_MAX:-8192} --json $OUT/prefill_s41.jsonl > $OUT/prefill_s41.log 2>&1; echo "rc=$?" >> $S
  grep -A 18 "^ *model |" $OUT/prefill_s41.log | grep -vE "INFO|WARNING" | head -80 >> $S
  fi
  # a device call returns at most 8 files: the logs and rows go back as one archive beside summary.txt
  (cd $OUT && tar czf s41_logs.tgz $(ls *.log *.jsonl *.json 2>/dev/null) && rm -f *.log *.jsonl *.json)
fi
if [ $PART = s43 ]; then   # session 43: what sessions 41-42 owe, in priority order
  s43() { [[ " ${S43:-order moe step} " == *" $1 "* ]]; }   # S43= picks steps (also: tests wide tma, run in session 43)
  s43 tests && echo "== gpu tests: the wide decode group (16 decodes + a 128-row tail, 4 splits); the split fp32 GEMM's bound" >> $S
  s43 tests && for f in "tests/gpu/test_cuda_mla_decode.py" "tests/gpu/test_cuda_routing.py -k fp32_linear_prefill_split"; do
    timeout ${TEST_LIM:-100} python3 -m pytest -q -p no:cacheprovider $f > $OUT/t.log 2>&1
    echo "$f rc=$? $(tail -1 $OUT/t.log)" >> $S; grep -E "^(FAILED|ERROR|E  )" $OUT/t.log | cut -c1-300 | head -12 >> $S
  done
  if s43 wide; then
  echo "== bench.attention decode: eager decode groups wider than the SMs (splits 0 = auto)" >> $S
  timeout ${ATT_LIM:-100} python3 -m glm_ray.bench.attention --heads 32 64 --batch 144 192 --contexts 2048 \
     --sparse-contexts --splits 0 1 2 4 --no-reference --iters 30 --json $OUT/wide_decode.jsonl > $OUT/wide_decode.log 2>&1
  echo "rc=$?" >> $S; grep -vE "INFO|WARNING" $OUT/wide_decode.log | tail -20 >> $S
  fi
  if s43 order; then
  echo "== bench.attention prefill: launch order 1 (head by head) vs 4 (default), x2 interleaved" >> $S
  timeout ${ATT_LIM:-100} python3 -m glm_ray.bench.attention --mode prefill --heads 32 --prefill-shapes 8x1024 1x8192 \
     --no-reference --head-groups 1 4 1 4 --iters 20 --json $OUT/launch_order.jsonl > $OUT/launch_order.log 2>&1
  echo "rc=$?" >> $S; grep -vE "INFO|WARNING" $OUT/launch_order.log | tail -14 >> $S
  fi
  s43 tma && for c in "128 64 8 2" "64 64 8 2"; do
    echo "== bench.attention prefill: key tiles pointer vs TMA at $c" >> $S
    timeout ${ATT_LIM:-100} python3 -m glm_ray.bench.attention --mode prefill --heads 32 --prefill-shapes 8x1024 1x8192 \
       --no-reference --key-loads pointer tma --config $c --iters 20 --json $OUT/attn_tma.jsonl > $OUT/t.log 2>&1
    echo "rc=$?" >> $S; grep -vE "INFO|WARNING" $OUT/t.log | tail -10 >> $S; cat $OUT/t.log >> $OUT/attn_tma.log
  done; rm -f $OUT/t.log
  if s43 moe; then
  echo "== bench.moe_prefill new kernels: one vs two CTAs an SM, persistent (:p1)" >> $S
  timeout ${MOE_LIM:-150} python3 -m glm_ray.bench.moe_prefill --geo flash --mode fp8 --tokens 8192 --path new \
     --new-configs default 64:256:128:128:8:8:2:tma:r128 64:256:128:128:8:8:3:tma:p1 64:256:128:128:8:8:2:tma:p1 --stages \
     --json $OUT/moe_new.jsonl > $OUT/moe_new.log 2>&1; echo "rc=$?" >> $S
  grep -E "^ *(flash|glm5) " $OUT/moe_new.log | cut -c1-250 >> $S
  fi
  if s43 step; then   # the step with the defaults of this tree (TMA key loads on): vs session 43's 137.0 / 323.5 ms (H100)
  echo "== bench.prefill piecewise glm5-flash-31b" >> $S
  timeout ${STEP_LIM:-200} python3 -m glm_ray.bench.prefill glm5-flash-31b --shape 8x1024 1x8192 --quant fp8 --device cuda \
     --profile-top 14 --modes piecewise --piecewise-max-tokens 8192 --json $OUT/prefill_s43.jsonl > $OUT/prefill_s43.log 2>&1
  echo "rc=$?" >> $S; grep -A 18 "^ *model |" $OUT/prefill_s43.log | grep -vE "INFO|WARNING" | head -60 >> $S
  fi
fi
cat $S
