#!/usr/bin/env bash
# With little device time left: on an H200 only, build and bench issue 15's FP8 batch-64 figure on the e4m3
# cache (gpu_bench.py --only fp8kv); on another card, nothing. Run 44's h200_fp8.sh does it, with its parts named.
cd "$(dirname "$0")/../../.." || exit
BENCH_ONLY=fp8kv exec bash docs/gpu-runs/run44/h200_fp8.sh
