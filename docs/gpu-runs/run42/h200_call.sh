#!/usr/bin/env bash
# Issue 15's H200 figures, from the repository root: the gpu_check (build, GPU tests) and, on an H200 only,
# its bench of the FP8 and 4-bit parts with the call's time; on another card, build and tests alone.
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-results-tmp}
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$name"
bench=0
case "$name" in *H200*) bench=1 ;; esac
OUT=$OUT/check GPU_CHECK_HF=0 GPU_CHECK_CPU=0 GPU_CHECK_BENCH=$bench GPU_CHECK_SECONDS=$((575 - SECONDS)) \
  GPU_BENCH_ARGS="--only fp8kv,fp8,q4km,gptq4" bash scripts/gpu_check.sh 2>&1 | tail -n 45
