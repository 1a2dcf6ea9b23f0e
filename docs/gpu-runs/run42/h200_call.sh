#!/usr/bin/env bash
# Issue 15's H200 figures, from the repository root: on an H200 only (anything else stops at once), the
# gpu_check (build, GPU tests, then the bench of the FP8 and 4-bit parts) with the call's time.
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-results-tmp}
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$name"
case "$name" in *H200*) ;; *) echo "not an H200: nothing run"; exit 0 ;; esac
OUT=$OUT/check GPU_CHECK_HF=0 GPU_CHECK_CPU=0 GPU_CHECK_SECONDS=$((575 - SECONDS)) \
  GPU_BENCH_ARGS="--only fp8kv,fp8,q4km,gptq4" bash scripts/gpu_check.sh 2>&1 | tail -n 45
