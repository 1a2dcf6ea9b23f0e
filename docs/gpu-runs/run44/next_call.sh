#!/usr/bin/env bash
# Run 44's device call, from the repository root. First, here:
#   mkdir -p build/ab && git archive <main before> exlcli scripts > build/ab/old.tar
# then carry build/ab and .whl. On the device it builds this tree and the old one at once, then, alternating
# the two builds: run 32's decode_rows.py (the decode linear alone, 1-4 rows, e4m3 and bf16, PDL off) and
# run 41's decode_ab.py (DECODE_RUNS, default FP8 batch 1 and 2 through the Engine).
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-results-tmp}
mkdir -p "$OUT"
export EXLCLI_KERNEL_CACHE=$PWD/build/kernels
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/old && tar -xf build/ab/old.tar -C /tmp/old && cp -r docs /tmp/old/
load='from exlcli.ops.cuda import loader; print(loader.load(), loader.reason())'
(cd /tmp/old && EXLCLI_KERNEL_CACHE=/tmp/old/build/kernels timeout 200 python3 -c "$load" >"$OUT/old-build.log" 2>&1) &
timeout 200 python3 -c "$load" >"$OUT/new-build.log" 2>&1
wait
echo "builds at $SECONDS s: new $(tail -n 1 "$OUT/new-build.log"), old $(tail -n 1 "$OUT/old-build.log")"
timeout 120 python3 -m pytest tests/gpu -p no:cacheprovider -q -rf -k "fp8 or e4m3 or decode_linear" >"$OUT/tests.log" 2>&1
echo "tests at $SECONDS s: $(grep -E "passed|failed|error" "$OUT/tests.log" | tail -n 1)"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 30
rows=docs/gpu-runs/run32/decode_rows.py
ab=docs/gpu-runs/run41/decode_ab.py
for _ in 1 2; do
  [ "$SECONDS" -gt 400 ] && break
  PYTHONPATH=$PWD:${PYTHONPATH:-} timeout 90 python3 $rows new
  (cd /tmp/old && PYTHONPATH=/tmp/old:${PYTHONPATH:-} EXLCLI_KERNEL_CACHE=/tmp/old/build/kernels timeout 90 python3 $rows old)
done 2>&1 | grep -E "^(new|old) |Error|error" | tee "$OUT/rows.txt"
echo "rows at $SECONDS s"
for _ in 1 2; do
  [ "$SECONDS" -gt 480 ] && break
  timeout 100 python3 $ab new --runs "${DECODE_RUNS:-fp8:1+2}"
  (cd /tmp/old && EXLCLI_KERNEL_CACHE=/tmp/old/build/kernels timeout 100 python3 $ab old --runs "${DECODE_RUNS:-fp8:1+2}")
done 2>&1 | grep -E "^(new|old) |Error|error" | tee "$OUT/decode_ab.txt"
echo "done at $SECONDS s"
