#!/usr/bin/env bash
# The GPU measurements of the FP8 / TTFT-under-load work, one stage per device command: each stage
# ends well inside a device command's 10 minutes (its `timeout` below is the bound; the times in
# the comments are the H200's). Results (JSON + markdown + a log per stage) go under $OUT.
#
#   OUT=/some/dir bash bench/gpu_run.sh STAGE [STAGE...]   # stages run in the order given
#   SMOKE=1 OUT=/tmp/x bash bench/gpu_run.sh engine load goodput   # the plumbing on a CPU: tiny model, seconds
# More than 8 files under $OUT at the end are bundled into $OUT/all.tgz (the device tool returns 8 at most).
#
# Stages (run each as its own device command; a failure does not stop the next):
#   tests       GPU tests (tests/workers/engine/test_gpu.py), measurements to measure.jsonl      ~3 min
#   kernels     FP8 GEMMs: _scaled_mm per channel vs bf16 (bench_kernels; ~3 min with the group GEMMs, less now)
#   decode_gemms  a decode step's GEMMs: bf16, _scaled_mm, the small-M kernel's configs (bench_fp8_decode)  ~1 min
#   engine      TTFT and decode: bf16, FP8 + fp8 KV (FP8 attention), the same with bf16 attention; transformers  ~5 min
#   fp8_head    decode b1-b256: fp8+kv8 against fp8-head+kv8 (EngineConfig.fp8_lm_head)           ~3 min
#   fused_ab    decode's fused rope + Triton argmax against the unfused (fp8-unfused), _scaled_mm's fast
#               accumulation (bench_fp8_accum, then fp8-fastacc in the engine), decode b1/b8 at max_model_len
#               33024 (the full TTFT bench's) against 2432                                            ~6 min
#   gemv_sweep  the one-row GEMV's tiles (bench_fp8_gemv --rows 1), then
#               decode b1/b8 with the sweep's picks (FIRSTTOKEN_FP8_GEMV_CONFIG) against the defaults    ~3 min
#   throughput  offline throughput, 1000 prompts of 1000 + 1000 tokens (TensorRT-LLM's shape): FP8, bf16  ~6 min
#   next24      session 24's first call: H200 tiles, throughput (default, rows16), table; else reserve/hnd    ~9 min
#   dec_profile where a decode step's time goes (torch profiler): b1, and b1000 (H200) / b600 (H100) at ctx 1500  ~3 min
#   reserve_ab  offline throughput with kv_reserve 0.85 and none against the default (auto)              ~7 min
#   gemm_rows   the FP8 GEMMs at 512 / 1024 / 8192 rows (a throughput run's steps) against their floor   ~1.5 min
#   next24b     H200: throughput of the default and fp8-rows16; elsewhere the default's alone          ~5 / 2.5 min
#   next25      H200 only: throughput of the default, the issue's table (bf16, fp8+kv8), bf16's throughput ~9 min
#   next28      H200 only: next25 without bf16's throughput                                          ~8 min
#   fused_rope  decode b1-b512, rope_and_cache fused into the decode attention at every batch vs the default ~3 min
#   rope_ab     FP8 attention's rope + cache write + cast in one launch (the default) against two: GPU
#               tests, the kernels alone (bench_rope_tiles), TTFT of each                             ~5 min
#   prefill_pf  cached + 128's paged attention with the block ids a tile ahead (two K/V buffers at 3 stages):
#               the kernel (ncu_prefill_cached), its GPU tests, then TTFT 512 / 2048 / cached + 128 A/B   ~5 min
#   dec_rate    decode attention's read rate in the default layout (blocks of 64, keys-inner V, block ids a tile
#               ahead) against tile variants, B 1-1000 (bench_decode_tiles), then dec_profile: the H200's rate
#               there was last measured before that layout (77% of its copy rate, session 19)       ~5 min
#   h200_only   on an H200 only (else it stops at once): throughput of the default, then of fp8-rows16   ~4 min
#   table_bs64  the issue's table with fp8-rows16+kv8 beside bf16 and fp8+kv8, then every GPU test           ~7 min
#   logits32    the lm_head's GEMM writing fp32 logits against bf16 + a cast: GPU tests, throughput of each ~6.5 min
#   overlap_micro  decode attention beside the FP8 GEMMs on two streams, alone and serial (bench_overlap) ~1 min
#   prefill_tiles  cached + 128's paged attention over more splits and other tiles (ncu_prefill_cached) ~1.5 min
#   tma_ab      TTFT 2048 (cached + 128), fp8+kv8 with the TMA GEMM off and on, one process          ~1.5 min
#   table       TTFT / decode of bf16 and fp8+kv8 beside their floors (the issue's table; no transformers)  ~3 min
#   gemm_tma    128/256-row FP8 GEMMs with TMA loads (bench_fp8_decode --tma), then TTFT 2048 cached + 128
#               without TMA, with the built-in tiles and with the sweep's picks                    ~5 min
#   prefill_k8  2048 cached + 128's paged attention: QK^T on FP8 tensor cores, with tiles (ncu_prefill_cached),
#               then TTFT 2048 / cached + 128 and decode b1 with and without it in the engine      ~3 min
#   fp8attn     cuDNN's FP8 dense prefill attention (bench_fp8_attention), its GPU tests, then TTFT 2048 / 8192 /
#               32768 with it (fp8+kv8) and without (fp8-bf16attn+kv8)                             ~6 min
#   compact_ab  the prefill attention's compact grid (the default since session 20) against the grid per
#               sequence: kernel at 16 / 1 graph rows, the GPU tests, TTFT A/B                     ~5 min
#   cached_probe  cached + 128's paged attention: block-table rows 1 against the graph's 16, then ncu's warp states  ~1.5 min
#   ncu_layouts ncu of one decode-attention launch per V layout                                        ~2 min
#   throughput_mem  the same shape, FP8 + fp8 KV alone, at gpu_memory_utilization 0.90 then 0.95 (fewer
#               preemptions; the stats give peak memory against the device's total)                  ~4.5 min
#   ttft_probe  where TTFT 2048 and 2048 cached + 128 spend the time outside their kernels (FP8 + fp8 KV:
#               profile_engine's timeline of idle gaps and the CPU op in each), then bench_engine TTFT 2048
#               in the same call (TTFT 2048 measured 29.5 and 37.6 ms in two calls of session 5)      ~2.5 min
#   quality     FP8 on SmolLM2 with the real kernels (needs the model: bench/restore_smollm2.py)  ~2.5 min with
#               the group runs, less now
#   load        TTFT under load, bf16: targets none/15/20/30 ms at 8/16/24/32 req/s, 8 s each  ~3 min
#   goodput     the highest rate within MLPerf's interactive and server limits, bf16      ~3 min
#   goodput_t25 the interactive search with an engine TPOT target of 25 ms (no server search)  ~1 min
#   goodput_pg  the interactive search, no target, mixed steps of up to 128 sequences / 2048 tokens replayed
#               as prefill graphs (the default is 16 / 1024: larger mixed steps run eager)          ~1 min
#   goodput_core  the same through the worker's engine core in its own process (ProcessCore)  ~2.5 min
#   load_fp8    goodput with FP8 projections and an fp8 KV cache                            ~3 min
#   goodput_b2048  goodput, steps of at most 2048 tokens, bf16 then FP8 + fp8 KV (mixed graphs on:
#               the configuration of bench/results/2026-12-02-load-h200.md's best FP8 rows)    ~6 min
#   guided      guided decoding's cost at batch 64 (json_object, a JSON schema, masks in llguidance's pool
#               and in one thread) against unguided, bf16 then FP8 (bench_guided); needs SmolLM2's
#               tokenizer files in .tok (carry it; see bench_guided.py)                           ~3 min
#   choices     TTFT of a job with n = 1, 2, 4, 8 choices over one prompt (the siblings share its
#               blocks), prefix cache on and off (bench/bench_choices.py); issue 20: n=4 within 10%  ~2 min
# The SmolLM2 checkpoint does not fit one call: `python3 bench/restore_smollm2.py pack` here makes .ckpt_a
# (the GGUF's first 49 MB and the small files) and .ckpt_b; carry .ckpt_a and copy it to /tmp there,
# then in the next call (the machine still warm) carry .ckpt_b and rebuild with
# bench/restore_smollm2.py --parts '/tmp/ckpt_a/gguf.part*' '.ckpt_b/gguf.part*' (see its doc).
# Packages the device image lacks (pydantic, llguidance, the cudnn frontend) travel as wheels in .whl (carry it):
# `bash bench/device_wheels.sh` downloads them.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the results directory}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# a tree that differs from HEAD gets "+changes": the device's copy of the checkout can carry an older HEAD than
# its files (session 19 printed 34dd708 for 072eece's tree); set FIRSTTOKEN_COMMIT to name the commit by hand
export FIRSTTOKEN_COMMIT=${FIRSTTOKEN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- . 2>/dev/null || echo +changes)}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && ! $PY -c "import pydantic" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
[ -d /tmp/site ] && case ":${PYTHONPATH:-}:" in *:/tmp/site:*) ;; *) export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} ;; esac
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && { echo "name the stages to run (see the header): each is one device command"; exit 2; }

if [ "${SMOKE:-0}" = 1 ]; then  # a CPU run of the same commands, small
  DEV=(--device cpu); PRESET=tiny
  ENGINE_ARGS=(--ttft-lengths 64,256 --decode-batches 1,4 --no-hf --max-num-seqs 8)
  TPUT_ARGS=(--num-prompts 4 --input-len 64 --output-len 32 --no-hf --max-num-seqs 8)
  LOAD_ARGS=(--rates 8 --duration 2 --max-prompt 256)
  GOODPUT_ARGS=(--duration 2 --max-prompt 256 --search-rates 2,4 --search-steps 1)
  LOAD_TARGETS=none,50
else
  DEV=(); PRESET=llama3-8b
  ENGINE_ARGS=(); TPUT_ARGS=(--hf-prompts 32 --max-num-seqs 1024)
  LOAD_ARGS=(--rates 8,16,24,32 --duration 8)
  GOODPUT_ARGS=(--duration 12 --search-steps 1)
  LOAD_TARGETS=none,15,20,30
fi

declare -A STATUS
run() {  # run NAME SECONDS CMD...: log to $OUT/NAME.log, record the exit status
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name: $*" | tee "$OUT/$name.log"
  timeout "$limit" "$@" >>"$OUT/$name.log" 2>&1
  local rc=$?
  STATUS[$name]="rc=$rc $((SECONDS - t0))s"
  echo "=== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$OUT/$name.log"
  tail -25 "$OUT/$name.log" | grep -v "^===" || true
}
issue_table() {  # issue 18's table: TTFT and decode of bf16 and fp8+kv8 beside their floors (stages table, h200)
  run engine 170 $PY bench/bench_engine.py "${DEV[@]}" --preset $PRESET --sections ttft,decode \
    --engines bf16,fp8+kv8 --no-hf "${ENGINE_ARGS[@]}"
}
table_beside() {  # table_beside NAME ENGINE: the issue's table with ENGINE beside bf16 and fp8+kv8 (one process),
  # then every GPU test (table_bs64)
  run "engine_$1" 300 $PY bench/bench_engine.py "${DEV[@]}" --preset $PRESET --sections ttft,decode \
    --engines "bf16,fp8+kv8,$2" --no-hf "${ENGINE_ARGS[@]}"
  [ "${SMOKE:-0}" = 1 ] || FIRSTTOKEN_GPU_TESTS=1 FIRSTTOKEN_MEASURE_OUT="$OUT/measure.jsonl" run tests 280 \
    $PY -m pytest -q -s -m gpu tests/workers/engine/test_gpu.py -p no:cacheprovider -rA
}
on_h200() {  # the card is an H200 (the stages that measure the issue's H200 targets, or size a batch to its pool)
  $PY -c "import torch, sys; sys.exit('H200' not in torch.cuda.get_device_name())" 2>/dev/null
}
throughputs() {  # throughputs SECONDS ENGINE...: offline throughput of each engine, one process each (next24,
  # reserve_ab, h200_only)
  local limit=$1 e
  shift
  for e in "$@"; do
    run "throughput_${e%%+*}" "$limit" $PY bench/bench_engine.py "${DEV[@]}" --preset $PRESET --sections throughput \
      --engines "$e" --no-hf --gpu-memory-utilization 0.95 "${TPUT_ARGS[@]}"
  done
}

$PY - <<'EOF' >"$OUT/machine.txt" 2>&1
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(p.name, f"{p.total_memory / 2**30:.0f} GiB", p.multi_processor_count, "SMs", "sm", torch.cuda.get_device_capability(0))
EOF
cat "$OUT/machine.txt"

PREFILL_VARIANTS='{"k8": {"widen": "k8"}, "k8_s3": {"widen": "k8", "num_stages": 3},
 "k8_n128": {"widen": "k8", "block_n": 128}, "k8_m128": {"widen": "k8", "block_m": 128, "block_n": 64, "num_warps": 8,
 "num_stages": 2, "num_splits": 4}}'
BLOCK_VARIANTS='{"pf": {"prefetch": true}, "vt": {"v_layout": "keys_inner", "prefetch": false}, "vtpf": {"v_layout": "keys_inner", "prefetch": true}}'
RATE_VARIANTS='{"vtpf": {"v_layout": "keys_inner"}, "vtpf_n128": {"v_layout": "keys_inner", "block_n": 128},
 "vtpf_s2": {"v_layout": "keys_inner", "num_stages": 2}, "vtpf_s4": {"v_layout": "keys_inner", "num_stages": 4},
 "vtpf_w4": {"v_layout": "keys_inner", "num_warps": 4}, "vtpf_n128_w4": {"v_layout": "keys_inner", "block_n": 128,
 "num_warps": 4}, "vt_nopf": {"v_layout": "keys_inner", "prefetch": false}}'
PREFILL_TILES='{"s6": {"num_splits": 6}, "s8": {"num_splits": 8}, "n128_s4": {"block_n": 128, "num_splits": 4},
 "m128n128w8_s8": {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2, "num_splits": 8},
 "w8_s4": {"num_warps": 8, "num_splits": 4}, "m32_s8": {"block_m": 32, "num_splits": 8}}'
for stage in "${STAGES[@]}"; do
  case $stage in
    tests)
      [ "${SMOKE:-0}" = 1 ] && continue
      FIRSTTOKEN_GPU_TESTS=1 FIRSTTOKEN_MEASURE_OUT="$OUT/measure.jsonl" run tests 560 \
        $PY -m pytest -q -s -m gpu tests/workers/engine/test_gpu.py -p no:cacheprovider -rA ;;
    kernels)
      [ "${SMOKE:-0}" = 1 ] && continue
      run kernels 560 $PY bench/bench_kernels.py --sections fp8 --out "$OUT" --commit "$FIRSTTOKEN_COMMIT" ;;
    decode_gemms)
      [ "${SMOKE:-0}" = 1 ] && continue
      run decode_gemms 400 $PY bench/bench_fp8_decode.py ;;
    gemm_rows)  # the projections' FP8 GEMMs (_scaled_mm, its swapped and fast-accumulating forms) and bf16 at a
      # throughput run's row counts: ~500 / ~1000 decodes a step, 8192-token mixed steps, against the floor  ~1.5 min
      [ "${SMOKE:-0}" = 1 ] && continue
      run gemm_rows 200 $PY bench/bench_fp8_decode.py --rows 512,1024,8192 --no-sweep --weights-mib 256 ;;
    engine)
      run engine 560 $PY bench/bench_engine.py "${DEV[@]}" --preset $PRESET --sections ttft,decode \
        --engines bf16,fp8+kv8,fp8-bf16attn+kv8 "${ENGINE_ARGS[@]}" ;;
    fp8_head)  # the opt-in FP8 lm_head against the bf16 head, decode (both fp8 + fp8 KV)
      run fp8_head 400 $PY bench/bench_engine.py "${DEV[@]}" --preset $PRESET --sections decode \
        --engines fp8+kv8,fp8-head+kv8 --no-hf "${ENGINE_ARGS[@]}" ;;
    fused_ab)
      [ "${SMOKE:-0}" = 1 ] && continue
      run fp8_accum 150 $PY bench/bench_fp8_accum.py
      run fused_ab 330 $PY bench/bench_engine.py "${DEV[@]}" --preset $PRESET --sections ttft,decode --ttft-lengths 2048 \
        --engines fp8+kv8,fp8-unfused+kv8,fp8-fastacc+kv8 --no-hf "${ENGINE_ARGS[@]}"
      run long_table 120 $PY bench/bench_engine.py "${DEV[@]}" --preset $PRESET --sections decode --decode-batches 1,8 \
        --max-model-len 33024 --engines fp8+kv8 --no-hf ;;
    gemv_sweep)
      [ "${SMOKE:-0}" = 1 ] && continue
      run gemv_sweep 200 $PY bench/bench_fp8_gemv.py --rows 1
      FIRSTTOKEN_FP8_GEMV_CONFIG="$OUT/gemv_best.json" run gemv_picks 150 $PY bench/bench_engine.py "${DEV[@]}" \
        --preset $PRESET --sections decode --decode-batches 1,8 --max-model-len 2432 --engines fp8+kv8 --no-hf ;;
    throughput)
      run throughput 560 $PY bench/bench_engine.py "${DEV[@]}" --preset $PRESET --sections throughput \
        --engines fp8+kv8,bf16+kv8 "${TPUT_ARGS[@]}" ;;
    ncu_layouts)  # ncu of one decode-attention launch per V layout (B = 1000, context 1500): why keys-inner, with
      # 41% fewer instructions a tile, ran no faster (bench/results/2026-12-06-v-layout-h100.md)
      [ "${SMOKE:-0}" = 1 ] && continue
      NCU=$(ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      run ncu_layouts 220 "${NCU:-ncu}" --clock-control none -k regex:_decode_partial --launch-skip 2 --launch-count 4 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
        --section Occupancy --section LaunchStats $PY bench/ncu_decode_layouts.py ;;
    fp8attn)  # cuDNN's FP8 dense prefill attention: the kernel beside bf16, its GPU tests, TTFT with and without it
      [ "${SMOKE:-0}" = 1 ] || run fp8_attention_probe 150 $PY bench/bench_fp8_attention.py --probe 16,32,64,128,256/37,128,1000
      [ "${SMOKE:-0}" = 1 ] || run fp8_attention 120 $PY bench/bench_fp8_attention.py
      [ "${SMOKE:-0}" = 1 ] || FIRSTTOKEN_GPU_TESTS=1 FIRSTTOKEN_MEASURE_OUT="$OUT/measure.jsonl" run tests_fp8attn 150 \
        $PY -m pytest -q -s -m gpu tests/workers/engine/test_gpu.py -p no:cacheprovider -rA -k "fp8_attention"
      run ttft_fp8attn 280 $PY bench/bench_engine.py "${DEV[@]}" --preset $PRESET --sections ttft \
        --ttft-lengths 2048,8192,32768 --engines fp8+kv8,fp8-bf16attn+kv8 --no-hf ;;
    prefill_k8)  # the paged prefill attention of 2048 cached + 128 over an fp8 cache: QK^T on FP8 tensor cores (widen
      # k8) with tiles; then TTFT 2048 (cached + 128) and decode b1 with and without it              ~3 min
      [ "${SMOKE:-0}" = 1 ] || run prefill_cached 150 $PY bench/ncu_prefill_cached.py --variants "$PREFILL_VARIANTS"
      run ttft_k8 330 $PY bench/bench_engine.py "${DEV[@]}" --preset $PRESET --sections ttft,decode --ttft-lengths 2048 \
        --decode-batches 1 --engines fp8+kv8,fp8-k8+kv8 --no-hf ;;
    compact_ab)  # the paged prefill attention's compact grid (the default; FIRSTTOKEN_PREFILL_COMPACT=0: programs for the prefill
      # graph's padded sequences; 16 rows cost 2.25 us a layer over one at cached + 128 on the H200, session 19):
      # the kernel at 16 and 1 graph rows, the prefill GPU tests with it on, then TTFT 2048 / cached + 128 and
      # TTFT 512 of fp8 and bf16 with and without it, one process                                   ~5 min
      [ "${SMOKE:-0}" = 1 ] || for rows in 16 1; do
        run "compact_rows$rows" 60 $PY bench/ncu_prefill_cached.py --rows $rows --variants '{"nocompact": {"compact": false}}'; done
      [ "${SMOKE:-0}" = 1 ] || FIRSTTOKEN_GPU_TESTS=1 run tests_compact 200 $PY -m pytest -q -s \
        -m gpu tests/workers/engine/test_gpu.py -p no:cacheprovider -rA -k "prefill or graph or compiles or choices"
      run ttft_compact 280 $PY bench/bench_engine.py "${DEV[@]}" --preset $PRESET --sections ttft --ttft-lengths 512,2048 \
        --engines fp8+kv8,fp8-nocompact+kv8,bf16,bf16-nocompact --no-hf ;;
    cached_probe)  # why cached + 128's paged attention takes ~26 us against ~6 of FLOPs: the graph's 15 padding rows
      # (block-table rows 1 against 16), then ncu's warp states and occupancy of one launch          ~1.5 min
      [ "${SMOKE:-0}" = 1 ] && continue
      run prefill_rows1 60 $PY bench/ncu_prefill_cached.py --rows 1
      run prefill_rows16 60 $PY bench/ncu_prefill_cached.py --rows 16
      NCU=$(ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      run ncu_prefill 150 "${NCU:-ncu}" --clock-control none -k regex:_paged_attention --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
        --section Occupancy --section LaunchStats --section SourceCounters $PY bench/ncu_prefill_cached.py --ncu ;;
    prefill_tiles)  # 2048 cached + 128's paged attention (fp16-widened fp8 cache) over more splits and other tiles than
      # the default's M64 N64 w4 s2 x 4 splits (ncu_prefill_cached, graph-replayed)                    ~1.5 min
      [ "${SMOKE:-0}" = 1 ] || run prefill_tiles 150 $PY bench/ncu_prefill_cached.py --variants "$PREFILL_TILES" ;;
    tma_ab)  # TTFT 2048 (cached + 128) with the TMA GEMM off, then on, in one process                ~1.5 min
      run tma_ab 200 $PY bench/bench_engine.py "${DEV[@]}" --preset $PRESET --sections ttft --ttft-lengths 2048 \
        --engines fp8-notma+kv8,fp8+kv8 --no-hf ;;
    table)  # the issue's table alone: TTFT and decode for bf16 and fp8+kv8 beside their floors      ~3 min
      issue_table ;;
    gemm_tma)  # the 128/256-row FP8 GEMMs with TMA loads against _scaled_mm and the pointer kernel (bench_fp8_decode
      # --tma), then TTFT 2048 cached + 128 without TMA (FIRSTTOKEN_FP8_TMA_CONFIG=off), with the built-in tiles and
      # with the sweep's picks                                                                           ~5 min
      [ "${SMOKE:-0}" = 1 ] || run gemm_tma 260 $PY bench/bench_fp8_decode.py --rows 128,256 --tma \
        --configs-m '[[64,32,256,4,4],[128,64,128,8,3],[64,64,256,4,3],[128,64,128,8,3,2]]'
      FIRSTTOKEN_FP8_TMA_CONFIG=off run ttft_base 120 $PY bench/bench_engine.py "${DEV[@]}" --preset $PRESET \
        --sections ttft --ttft-lengths 2048 --engines fp8+kv8 --no-hf
      run ttft_builtin 120 $PY bench/bench_engine.py "${DEV[@]}" --preset $PRESET --sections ttft --ttft-lengths 2048 \
        --engines fp8+kv8 --no-hf
      if [ -f "$OUT/tma_config.json" ]; then
        FIRSTTOKEN_FP8_TMA_CONFIG="$OUT/tma_config.json" run ttft_tma 120 $PY bench/bench_engine.py "${DEV[@]}" \
          --preset $PRESET --sections ttft --ttft-lengths 2048 --engines fp8+kv8 --no-hf
      fi ;;
    next24)  # session 24's first call. On an H200: the decode tiles at blocks of 16 / 64, offline throughput of the
      # default and fp8-rows16 (one process each), then the issue's table beside fp8-rows16 (no tests: they passed on
      # an H100 at b2d29da / fb05c41). Elsewhere: throughput of fp8-reserve85, the default and fp8-hnd
      #                                                                                ~9 min (H200), ~6.5 (H100)
      if on_h200; then
        run decode_blocks 45 $PY bench/bench_decode_tiles.py --layouts shuffled,hnd --block-sizes 16,64 \
          --cases 1000x1500 --variants "$BLOCK_VARIANTS"
        throughputs 150 fp8+kv8 fp8-rows16+kv8
        run engine_bs64 200 $PY bench/bench_engine.py "${DEV[@]}" --preset $PRESET --sections ttft,decode \
          --engines "bf16,fp8+kv8,fp8-rows16+kv8" --no-hf "${ENGINE_ARGS[@]}"
      else
        throughputs 170 fp8-reserve85+kv8 fp8+kv8 fp8-hnd+kv8
      fi ;;
    dec_profile)  # where a decode step's time goes, FP8 + fp8 KV (the default layout), torch profiler: batch 1 at
      # context 1500 and the throughput shape's full batch at context ~1500 (1000 on an H200; 500 fits an H100's pool: 600
      # did not, and the profiler's wait for every sequence to decode ran out of time, session 24)              ~3 min
      [ "${SMOKE:-0}" = 1 ] && continue
      BIG=500; on_h200 && BIG=1000
      [ "${DEC_BIG_ONLY:-0}" = 1 ] && DEC_BATCHES=$BIG  # the full batch alone
      run dec_profile 280 $PY bench/profile_engine.py --quantization fp8 --kv-cache-dtype fp8 --cases "" \
        --decode-batches "${DEC_BATCHES:-1,$BIG}" --decode-prompt-len 1500 --max-num-seqs 1024 --rows 16 ;;
    reserve_ab)  # admission with kv_reserve 0.85 and none against the default ("auto" since session 24): offline
      # throughput, one process each (with no reserve the H100 run preempted 405 times, ~560k tokens recomputed) ~7 min
      throughputs 170 fp8-reserve85+kv8 fp8-noreserve+kv8 fp8+kv8 ;;
    next24b)  # on an H200: offline throughput of the default (blocks of 64, keys-inner V, prefetch; kv_reserve auto),
      # then of fp8-rows16 (the layout before), one process each (~5 min); elsewhere the default's alone (~2.5 min)
      if on_h200; then
        throughputs 150 fp8+kv8 fp8-rows16+kv8
      else
        throughputs 170 fp8+kv8
      fi ;;
    next25)  # on an H200: offline throughput of the default (fp8+kv8, kv_reserve auto), the issue's table (bf16 and
      # fp8+kv8, one process), then bf16's throughput (~9 min); elsewhere nothing (the GPU tests passed on an H100
      # at e695a58, session 25)
      if on_h200; then
        throughputs 170 fp8+kv8
        run engine_table 300 $PY bench/bench_engine.py "${DEV[@]}" --preset $PRESET --sections ttft,decode \
          --engines "bf16,fp8+kv8" --no-hf "${ENGINE_ARGS[@]}"
        throughputs 200 bf16  # the issue wants bf16 beside FP8 in the same run (last: a cut call loses only it)
      else
        echo "not an H200: nothing run"
      fi ;;
    next28)  # next25 without bf16's throughput (~8 min: what fits a session's device time left after refused starts)
      if on_h200; then
        throughputs 170 fp8+kv8
        run engine_table 300 $PY bench/bench_engine.py "${DEV[@]}" --preset $PRESET --sections ttft,decode \
          --engines "bf16,fp8+kv8" --no-hf "${ENGINE_ARGS[@]}"
      else
        echo "not an H200: nothing run"
      fi ;;
    rope_ab)  # FP8 attention's rope + cache write + e4m3 cast in one launch (the default since session 26) against
      # two: their GPU tests (bit-exact), the kernels alone (bench_rope_tiles), TTFT of each, one process   ~5 min
      if [ "${SMOKE:-0}" = 1 ]; then RT=(--tokens 70 --tiles 16,32); else RT=(); fi
      [ "${SMOKE:-0}" = 1 ] || FIRSTTOKEN_GPU_TESTS=1 FIRSTTOKEN_MEASURE_OUT="$OUT/measure.jsonl" run tests_rope 150 \
        $PY -m pytest -q -s -m gpu tests/workers/engine/test_gpu.py -p no:cacheprovider -rA -k "rope or fp8_attention"
      run rope_kernels 120 $PY bench/bench_rope_tiles.py --out "$OUT" "${RT[@]}"
      run rope_ttft 330 $PY bench/bench_engine.py "${DEV[@]}" --preset $PRESET --sections ttft \
        --engines "fp8+kv8,fp8-noropecast+kv8" --no-hf "${ENGINE_ARGS[@]}" ;;
    prefill_pf)  # the paged prefill attention with each key tile's block ids loaded a tile ahead (FIRSTTOKEN_PREFILL_
      # PREFETCH=1): compiled for sm90 its K and V tiles get two shared buffers at 3 stages (one without), so the
      # next tile's copy runs under this tile's math (bench/probe_attention_sm90.py). The kernel at 2048 cached +
      # 128 in the engine's layout beside 3 stages alone, its GPU tests (bit-equal outputs, nothing compiled
      # after start), then TTFT with and without it in one process                                       ~5 min
      [ "${SMOKE:-0}" = 1 ] || run prefill_pf_kernel 120 $PY bench/ncu_prefill_cached.py \
        --variants '{"s3": {"num_stages": 3}, "pf": {"prefetch": true}, "pf_s4": {"prefetch": true, "num_stages": 4}}'
      [ "${SMOKE:-0}" = 1 ] || FIRSTTOKEN_GPU_TESTS=1 FIRSTTOKEN_MEASURE_OUT="$OUT/measure.jsonl" run tests_pf 200 \
        $PY -m pytest -q -s -m gpu tests/workers/engine/test_gpu.py -p no:cacheprovider -rA \
        -k "prefetch or never_compiles"
      if [ "${SMOKE:-0}" = 1 ]; then TL=(--ttft-lengths 64); else TL=(--ttft-lengths 512,2048); fi
      run prefill_pf_ttft 240 $PY bench/bench_engine.py "${DEV[@]}" --preset $PRESET --sections ttft \
        --engines "fp8+kv8,fp8-prefillpf+kv8" --no-hf "${TL[@]}" ;;
    dec_rate)  # decode attention in the engine's layout (blocks of 64, keys-inner V, prefetch) beside tile variants
      # that keep more bytes in flight (128-key tiles, more stages, 4 warps), then where a decode step's time goes
      # (dec_profile: b1 and the throughput shape's full batch). On the H200 a decode step at ~900 sequences spent
      # ~27 of ~43 ms on attention at 3.2-3.3 TB/s, 77% of the copy rate (session 19, before this layout); an
      # H100 read 96.5% of its own in the same layout (session 25)                                      ~5 min
      [ "${SMOKE:-0}" = 1 ] && continue  # (both need CUDA)
      run dec_rate 150 $PY bench/bench_decode_tiles.py --block-sizes 64 --cases 1x2048,256x1100,1000x1500,1000x1900 \
        --variants "$RATE_VARIANTS"
      BIG=500; on_h200 && BIG=1000
      run dec_profile 280 $PY bench/profile_engine.py --quantization fp8 --kv-cache-dtype fp8 --cases "" \
        --decode-batches "1,$BIG" --decode-prompt-len 1500 --max-num-seqs 1024 --rows 16 ;;
    fused_rope)  # rope_and_cache inside the decode attention at every batch (fp8-fusedall) against the default (up
      # to 64 since session 25, 16 before): with V's keys innermost, rope_and_cache's own launch writes each token's
      # V byte by byte (16 us a layer at b500 on an H100, session 25), one process                         ~3 min
      if [ "${SMOKE:-0}" = 1 ]; then DB=(--decode-batches 1,4); else DB=(--decode-batches 1,64,256,512); fi
      run fused_rope 300 $PY bench/bench_engine.py "${DEV[@]}" --preset $PRESET --sections decode \
        --engines "fp8+kv8,fp8-fusedall+kv8" --no-hf "${DB[@]}" ;;
    h200_only)  # only on an H200 (elsewhere it stops at once, its device time spent on the start alone): throughput of
      # the default (blocks of 64, keys-inner V, prefetch), then of fp8-rows16 (the layout before), one process each ~4 min
      if on_h200; then
        throughputs 150 fp8+kv8 fp8-rows16+kv8
      else
        echo "not an H200: nothing run"
      fi ;;
    table_bs64)  # the issue's table with blocks of 64 + keys-inner V + prefetch beside bf16 and fp8+kv8 (one process),
      # then every GPU test                                                                           ~7 min
      table_beside bs64 fp8-rows16+kv8 ;;
    logits32)  # the lm_head's GEMM writing fp32 logits (the default) against bf16 then a cast: its GPU test and
      # the logit-precision tests, then offline throughput of each (one process each)                 ~6.5 min
      [ "${SMOKE:-0}" = 1 ] || FIRSTTOKEN_GPU_TESTS=1 FIRSTTOKEN_MEASURE_OUT="$OUT/measure.jsonl" run tests_logits 150 \
        $PY -m pytest -q -s -m gpu tests/workers/engine/test_gpu.py -p no:cacheprovider -rA \
        -k "fp32_logits or logprobs or emulation or as_served"
      throughputs 150 fp8+kv8 fp8-bf16logits+kv8 ;;
    overlap_micro)  # one layer's decode attention and FP8 GEMMs x 32, alone, serial and on two streams (bench_overlap)  ~1 min
      [ "${SMOKE:-0}" = 1 ] || run overlap_micro 150 $PY bench/bench_overlap.py --rows 256,512 --context 1500 ;;
    throughput_mem)
      for mem in 0.9 0.95; do
        run "throughput_mem$mem" 270 $PY bench/bench_engine.py "${DEV[@]}" --preset $PRESET --sections throughput \
          --engines fp8+kv8 --no-hf --gpu-memory-utilization $mem "${TPUT_ARGS[@]}"
      done ;;
    ttft_probe)
      [ "${SMOKE:-0}" = 1 ] && continue
      run ttft_profile 200 $PY bench/profile_engine.py --quantization fp8 --kv-cache-dtype fp8 \
        --cases "ttft 2048,ttft 2048c+128" --decode-batches "" --host "ttft 2048c+128,ttft 2048"
      run ttft_2048 150 $PY bench/bench_engine.py --preset $PRESET --sections ttft --ttft-lengths 2048 \
        --engines fp8+kv8 --no-hf ;;
    quality)  # FP8 on SmolLM2 with the real kernels: compare with bench/results/*fp8-quality-cpu*
      [ "${SMOKE:-0}" = 1 ] && continue
      run quality 150 $PY bench/bench_fp8_quality.py --device cuda --out "$OUT/fp8_quality_channel.json"
      run quality_engine 240 $PY bench/bench_fp8_quality.py --engine --device cuda \
        --out "$OUT/fp8_quality_engine.json" ;;
    load)
      run load 560 $PY bench/bench_load.py "${DEV[@]}" --preset $PRESET "${LOAD_ARGS[@]}" --tpot-targets $LOAD_TARGETS ;;
    goodput)
      run goodput 560 $PY bench/bench_load.py "${DEV[@]}" --preset $PRESET --goodput "${GOODPUT_ARGS[@]}" ;;
    goodput_t25)
      run goodput_t25 560 $PY bench/bench_load.py "${DEV[@]}" --preset $PRESET --goodput --goodput-targets 25,skip \
        "${GOODPUT_ARGS[@]}" ;;
    goodput_pg)
      run goodput_pg 560 $PY bench/bench_load.py "${DEV[@]}" --preset $PRESET --goodput --goodput-targets none,skip \
        --prefill-graph-max-seqs 128 --prefill-graph-max-tokens 2048 "${GOODPUT_ARGS[@]}" ;;
    goodput_core)
      run goodput_core 560 $PY bench/bench_load.py "${DEV[@]}" --preset $PRESET --goodput --core process "${GOODPUT_ARGS[@]}" ;;
    load_fp8)
      run load_fp8 560 $PY bench/bench_load.py "${DEV[@]}" --preset $PRESET --quantization fp8 --kv-cache-dtype fp8 \
        --goodput "${GOODPUT_ARGS[@]}" ;;
    goodput_b2048)
      run goodput_b2048 280 $PY bench/bench_load.py "${DEV[@]}" --preset $PRESET --goodput --max-num-batched-tokens 2048 \
        "${GOODPUT_ARGS[@]}"
      run goodput_b2048_fp8 280 $PY bench/bench_load.py "${DEV[@]}" --preset $PRESET --goodput --max-num-batched-tokens 2048 \
        --quantization fp8 --kv-cache-dtype fp8 "${GOODPUT_ARGS[@]}" ;;
    choices)
      if [ "${SMOKE:-0}" = 1 ]; then
        run choices 200 $PY bench/bench_choices.py --preset tiny --device cpu --lens 100 --ns 1,4 --reps 2 --out "$OUT"
      else
        run choices 280 $PY bench/bench_choices.py --preset $PRESET --lens 512,2000 --ns 1,2,4,8 --out "$OUT"
      fi ;;
    guided)
      [ "${SMOKE:-0}" = 1 ] && { run guided 200 $PY bench/bench_guided.py --device cpu --preset tiny --tokenizer preset \
        --batch 8 --steps 12; continue; }
      run guided 280 $PY bench/bench_guided.py --preset $PRESET --tokenizer "${TOKENIZER:-.tok}"
      run guided_fp8 280 $PY bench/bench_guided.py --preset $PRESET --tokenizer "${TOKENIZER:-.tok}" \
        --quantization fp8 --kv-cache-dtype fp8 ;;
    *) echo "unknown stage $stage"; STATUS[$stage]="unknown" ;;
  esac
done

echo "=== summary ($FIRSTTOKEN_COMMIT)" | tee -a "$OUT/summary.txt"
for k in "${!STATUS[@]}"; do echo "$k: ${STATUS[$k]}"; done | sort | tee -a "$OUT/summary.txt"

# The device tool brings back at most 8 files from $OUT (bench/results/2026-12-03-session4-*: a tests.log
# was dropped that way): past 8, everything goes into one all.tgz beside summary.txt
# (`tar xzf /work/.device/N/all.tgz -C somewhere` here).
# (the archive is written outside $OUT, under mktemp: tar reading the folder it writes into may exit
# 1, "file changed as we read it"; and $OUT's parent need not be ours)
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  bundle=$(mktemp)
  tar czf "$bundle" -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete \
    && mv "$bundle" "$OUT/all.tgz" && chmod 644 "$OUT/all.tgz"
  echo "=== $OUT held more than 8 files: bundled into all.tgz"
fi
