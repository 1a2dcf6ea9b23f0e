#!/usr/bin/env bash
# Run 44's first call, from the repository root (see ../ab_trees.sh; carry build/ab and .whl): both builds,
# the FP8 and decode-linear GPU tests on this tree, then run 43's A/B (decode_rows.py, decode_ab.py).
set -uo pipefail
cd "$(dirname "$0")/../../.."
source docs/gpu-runs/ab_trees.sh
ab_build
timeout 120 python3 -m pytest tests/gpu -p no:cacheprovider -q -rf -k "fp8 or e4m3 or decode_linear" >"$OUT/tests.log" 2>&1
echo "tests at $SECONDS s: $(grep -E "passed|failed|error" "$OUT/tests.log" | tail -n 1)"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 30
decode_ab 400 480
