#!/usr/bin/env bash
# The device call run 38 left for the next session, in one command from the repository root. First, here:
#   mkdir -p build/ab && git show HEAD:exlcli/csrc/norm.cu > build/ab/norm_old.cu
#   git apply docs/gpu-runs/run38/norm-prefetch.patch
# then carry build/ab (and .whl where platformdirs is missing). On the device it:
# 1. builds the patched tree and the old norm.cu in a copy, at the same time;
# 2. runs every GPU test on the patched tree;
# 3. runs norm_ab.py on both builds, alternating twice (1 and 64 tokens);
# 4. on an H200 only, runs scripts/gpu_check.sh's bench for issue 15's figures with the time left.
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-results-tmp}
mkdir -p "$OUT"
export EXLCLI_KERNEL_CACHE=$PWD/build/kernels
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/old && cp -r exlcli scripts docs /tmp/old/ && cp build/ab/norm_old.cu /tmp/old/exlcli/csrc/norm.cu
load='from exlcli.ops.cuda import loader; print(loader.load(), loader.reason())'
(cd /tmp/old && EXLCLI_KERNEL_CACHE=/tmp/old/build/kernels timeout 150 python3 -c "$load" >"$OUT/old-build.log" 2>&1) &
timeout 150 python3 -c "$load" >"$OUT/new-build.log" 2>&1
wait
echo "builds at $SECONDS s: new $(tail -n 1 "$OUT/new-build.log"), old $(tail -n 1 "$OUT/old-build.log")"
timeout 120 python3 -m pytest tests/gpu -p no:cacheprovider -rf >"$OUT/tests.log" 2>&1
echo "tests at $SECONDS s: $(grep -E "passed|failed|error" "$OUT/tests.log" | tail -n 1)"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 20
for _ in 1 2; do
  timeout 40 python3 docs/gpu-runs/run38/norm_ab.py new
  (cd /tmp/old && EXLCLI_KERNEL_CACHE=/tmp/old/build/kernels timeout 40 python3 docs/gpu-runs/run38/norm_ab.py old)
done 2>&1 | grep -v Warn | tee "$OUT/norm_ab.txt"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  OUT=$OUT/check GPU_CHECK_HF=0 GPU_CHECK_CPU=0 GPU_CHECK_SECONDS=$((580 - SECONDS)) \
    GPU_BENCH_ARGS="--only fp8kv,fp8,q4km,gptq4" bash scripts/gpu_check.sh 2>&1 | tail -n 30
fi
