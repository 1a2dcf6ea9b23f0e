#!/usr/bin/env bash
# With little device time left: on an H200 only, build and bench issue 15's figures (gpu_bench.py --only
# $BENCH_ONLY, by default fp8kv,fp8: the e4m3 cache first, whose batch 64 is the open target), the log kept
# under $OUT as it goes so a call cut short still brings back what it measured; on another card, nothing.
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-results-tmp}
mkdir -p "$OUT"
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$name"
case "$name" in *H200*) ;; *) echo "not an H200: nothing run"; exit 0 ;; esac
export EXLCLI_KERNEL_CACHE=$PWD/build/kernels PYTHONUNBUFFERED=1
timeout 150 python3 -c 'from exlcli.ops.cuda import loader; print(loader.load(), loader.reason())' 2>&1 | tail -n 1
timeout $((${BENCH_SECONDS:-330} - SECONDS)) python3 scripts/gpu_bench.py --only "${BENCH_ONLY:-fp8kv,fp8}" --json "$OUT/fp8-bench.json" \
  2>&1 | tee "$OUT/fp8-bench.log" | tail -n 30
