#!/usr/bin/env bash
# With little device time left: on an H200 only, build and bench issue 15's FP8 batch-64 figure on the e4m3
# cache (gpu_bench.py --only fp8kv); on another card, nothing.
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-results-tmp}
mkdir -p "$OUT"
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$name"
case "$name" in *H200*) ;; *) echo "not an H200: nothing run"; exit 0 ;; esac
export EXLCLI_KERNEL_CACHE=$PWD/build/kernels
timeout 150 python3 -c 'from exlcli.ops.cuda import loader; print(loader.load(), loader.reason())' 2>&1 | tail -n 1
timeout $((330 - SECONDS)) python3 scripts/gpu_bench.py --only fp8kv --json "$OUT/fp8kv-bench.json" 2>&1 | tail -n 25
