#!/usr/bin/env bash
# Run 43's device call, from the repository root (see ../ab_trees.sh for build/ab/old.tar; carry build/ab
# and .whl). It builds this tree and the old one at once, then, alternating the two builds: run 32's
# decode_rows.py (the decode linear alone, 1-4 rows, e4m3 and bf16, PDL off) and run 41's decode_ab.py
# (DECODE_RUNS, default FP8 batch 1 and 2 through the Engine).
set -uo pipefail
cd "$(dirname "$0")/../../.."
source docs/gpu-runs/ab_trees.sh
ab_build
decode_ab 400 480
