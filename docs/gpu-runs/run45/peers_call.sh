#!/usr/bin/env bash
# Run 45: llama.cpp (../shared/peers, copied into the ignored peers/ and carried) beside exlcli on the same card,
# for issue 15's 4-bit figures. Stages, from the repository root, any subset, in order:
#   prep:  build llama.cpp (CUDA, sm_90) and exlcli's kernels at once, while the random 8B-shape GGUFs (Q4_K and
#          Q4_0, every weight of that type) are written
#   llama: llama-bench (pp512, tg128) and llama-batched-bench (128 + 128 tokens, 1 / 16 / 64 sequences) on them
#   exl2:  exllamav2 0.3.2 (its wheel installed under /tmp/site first) on a random GPTQ 4-bit g128 checkpoint
#          (peers/device_exl2.py), exlcli's kernels built beside its JIT build
#   ours:  gpu_bench.py --only q4km,gptq4 (Q4_K_M mix and GPTQ 4-bit g128)
# The build and the files go under the ignored peers-run/, which did not last to the next call even on a warm
# machine (run 45): run prep and llama in one call.
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-results-tmp}
mkdir -p "$OUT"
export EXLCLI_KERNEL_CACHE=$PWD/build/kernels PYTHONUNBUFFERED=1
export LB=$PWD/peers-run/lbuild GD=$PWD/peers-run/gguf RES=$OUT/llamacpp TYPES="q4_k q4_0"
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
load='from exlcli.ops.cuda import loader; print(loader.load(), loader.reason())'
for stage in "$@"; do
  case $stage in
    prep)
      bash peers/device_llamacpp.sh write >"$OUT/gguf-write.log" 2>&1 &
      timeout 300 python3 -c "$load" >"$OUT/exlcli-build.log" 2>&1 &
      JOBS=16 timeout 500 bash peers/device_llamacpp.sh build 2>&1 | tail -n 5
      wait
      echo "prep at $SECONDS s: exlcli $(tail -n 1 "$OUT/exlcli-build.log"); $(grep -c . "$OUT/gguf-write.log") write lines"
      tail -n 3 "$OUT/gguf-write.log"
      ls -la "$GD"
      ;;
    llama)
      timeout $((590 - SECONDS)) bash peers/device_llamacpp.sh bench 2>&1 | tail -n 30
      echo "llama at $SECONDS s"
      ;;
    exl2)
      timeout 300 python3 -c "$load" >"$OUT/exlcli-build.log" 2>&1 &
      EXL2_DEADLINE=$(($(date +%s) + 480 - SECONDS)) timeout $((540 - SECONDS)) python3 peers/device_exl2.py \
        >"$OUT/exl2.log" 2>&1
      wait
      grep -v '^ ' "$OUT/exl2.log" | tail -n 12
      echo "exl2 at $SECONDS s"
      ;;
    ours)
      timeout $((590 - SECONDS)) python3 scripts/gpu_bench.py --only q4km,gptq4 --json "$OUT/ours-bench.json" 2>&1 |
        tee "$OUT/ours-bench.log" | tail -n 25
      echo "ours at $SECONDS s"
      ;;
  esac
done
