#!/usr/bin/env bash
# Every GPU measurement the FP8 / TTFT-under-load work needs, in one command, for one device call
# (~25 minutes on an H200). Results (JSON + markdown + a log per stage) go under $OUT.
#
#   OUT=/some/dir bash bench/gpu_run.sh                 # every stage, in the order below
#   OUT=/some/dir bash bench/gpu_run.sh kernels engine  # some of them
#   SMOKE=1 OUT=/tmp/x bash bench/gpu_run.sh            # the plumbing on a CPU: tiny model, seconds
#
# Stages: tests kernels engine throughput quality load load_fp8. Each runs under its own time
# limit and a failure does not stop the next; the summary at the end lists each stage's status.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the results directory}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export FIRSTTOKEN_COMMIT=${FIRSTTOKEN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(tests kernels engine throughput quality load load_fp8)

if [ "${SMOKE:-0}" = 1 ]; then  # a CPU run of the same commands, small
  DEV=(--device cpu); PRESET=tiny
  ENGINE_ARGS=(--ttft-lengths 64,256 --decode-batches 1,4 --no-hf --max-num-seqs 8)
  TPUT_ARGS=(--num-prompts 4 --no-hf --max-num-seqs 8)
  LOAD_ARGS=(--rates 8 --duration 2 --max-prompt 256)
  LOAD_TARGETS=none,50; LOAD_FP8_TARGETS=none
else
  DEV=(); PRESET=llama3-8b
  ENGINE_ARGS=(); TPUT_ARGS=(--hf-prompts 32)
  LOAD_ARGS=(--rates 8,16,32 --duration 20)
  LOAD_TARGETS=none,15,20,30; LOAD_FP8_TARGETS=none,15,20
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
}

$PY - <<'EOF' >"$OUT/machine.txt" 2>&1
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(p.name, f"{p.total_memory / 2**30:.0f} GiB", p.multi_processor_count, "SMs", "sm", torch.cuda.get_device_capability(0))
EOF
cat "$OUT/machine.txt"

for stage in "${STAGES[@]}"; do
  case $stage in
    tests)  # the GPU tests (FP8 GEMMs, the engine with FP8 projections under CUDA graphs, ...)
      [ "${SMOKE:-0}" = 1 ] && continue
      FIRSTTOKEN_GPU_TESTS=1 run tests 600 $PY -m pytest -q -m gpu tests/engine/test_gpu.py -p no:cacheprovider ;;
    kernels)  # _scaled_mm per channel vs the Triton per-128 and block-wise GEMMs vs bf16
      [ "${SMOKE:-0}" = 1 ] && continue
      run kernels 600 $PY bench/bench_kernels.py --sections fp8 --sweep --out "$OUT" --commit "$FIRSTTOKEN_COMMIT" ;;
    engine)  # TTFT and decode: bf16 and FP8 engines beside transformers and each engine's floor
      run engine 900 $PY bench/bench_engine.py "${DEV[@]}" --preset $PRESET --sections ttft,decode \
        --engines bf16,fp8+kv8,fp8-g128+kv8,fp8-block+kv8 "${ENGINE_ARGS[@]}" ;;
    throughput)  # offline throughput, 1000 prompts, each engine (transformers on a subset)
      run throughput 900 $PY bench/bench_engine.py "${DEV[@]}" --preset $PRESET --sections throughput \
        --engines bf16+kv8,fp8+kv8,fp8-block+kv8 "${TPUT_ARGS[@]}" ;;
    quality)  # FP8 on SmolLM2 with the real kernels: compare with bench/results/*fp8-quality-cpu*
      [ "${SMOKE:-0}" = 1 ] && continue
      qdev=cuda
      run quality 300 $PY bench/bench_fp8_quality.py --device $qdev --out "$OUT/fp8_quality_channel.json"
      run quality_g64 300 $PY bench/bench_fp8_quality.py --device $qdev --group 64 --out "$OUT/fp8_quality_g64.json"
      run quality_block64 300 $PY bench/bench_fp8_quality.py --device $qdev --act-group 64 \
        --out "$OUT/fp8_quality_block64.json"
      # through firsttoken's engine on the GPU (Triton kernels, fused quantization) against the fp32 CPU engine:
      # compare with bench/results/2026-12-01-fp8-quality-engine-cpu.json
      run quality_engine 600 $PY bench/bench_fp8_quality.py --engine --device $qdev \
        --out "$OUT/fp8_quality_engine.json" ;;
    load)  # TTFT under load, bf16: Poisson arrivals at each rate, the TPOT-target trade-off curve
      run load 900 $PY bench/bench_load.py "${DEV[@]}" --preset $PRESET "${LOAD_ARGS[@]}" \
        --tpot-targets $LOAD_TARGETS ;;
    load_fp8)  # the same with FP8 projections and an fp8 KV cache
      run load_fp8 900 $PY bench/bench_load.py "${DEV[@]}" --preset $PRESET "${LOAD_ARGS[@]}" \
        --quantization fp8 --kv-cache-dtype fp8 --tpot-targets $LOAD_FP8_TARGETS ;;
    *) echo "unknown stage $stage"; STATUS[$stage]="unknown" ;;
  esac
done

echo "=== summary ($FIRSTTOKEN_COMMIT)" | tee "$OUT/summary.txt"
for k in "${!STATUS[@]}"; do echo "$k: ${STATUS[$k]}"; done | sort | tee -a "$OUT/summary.txt"
