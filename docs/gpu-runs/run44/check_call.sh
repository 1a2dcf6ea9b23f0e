#!/usr/bin/env bash
# Run 44's second call, from the repository root (see ../ab_trees.sh; carry build/ab and .whl): both builds;
# every GPU test on this tree; accuracy.py on both; decode_ab.py FP8 b1/b2 on both.
set -uo pipefail
cd "$(dirname "$0")/../../.."
source docs/gpu-runs/ab_trees.sh
ab_build
timeout 150 python3 -m pytest tests/gpu -p no:cacheprovider -rf >"$OUT/tests.log" 2>&1
echo "tests at $SECONDS s: $(grep -E "passed|failed|error" "$OUT/tests.log" | tail -n 1)"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 20
both_trees 60 docs/gpu-runs/run44/accuracy.py 2>&1 | grep -E "^(new|old) |Error|error" | tee "$OUT/accuracy.txt"
for _ in 1 2; do
  [ "$SECONDS" -gt 480 ] && break
  both_trees 100 docs/gpu-runs/run41/decode_ab.py --runs "${DECODE_RUNS:-fp8:1+2}"
done 2>&1 | grep -E "^(new|old) |Error|error" | tee "$OUT/decode_ab.txt"
echo "done at $SECONDS s"
