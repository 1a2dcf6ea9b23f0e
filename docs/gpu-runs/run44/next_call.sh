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
for _ in 1 2; do
  [ "$SECONDS" -gt 400 ] && break
  both_trees 90 docs/gpu-runs/run32/decode_rows.py
done 2>&1 | grep -E "^(new|old) |Error|error" | tee "$OUT/rows.txt"
echo "rows at $SECONDS s"
for _ in 1 2; do
  [ "$SECONDS" -gt 480 ] && break
  both_trees 100 docs/gpu-runs/run41/decode_ab.py --runs "${DECODE_RUNS:-fp8:1+2}"
done 2>&1 | grep -E "^(new|old) |Error|error" | tee "$OUT/decode_ab.txt"
echo "done at $SECONDS s"
