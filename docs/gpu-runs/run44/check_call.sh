#!/usr/bin/env bash
# Run 44's second call, from the repository root (carry build/ab with old.tar of main before, and .whl):
# both builds; every GPU test on this tree; accuracy.py on both; decode_ab.py FP8 b1/b2 and GPTQ b1 on both.
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
timeout 150 python3 -m pytest tests/gpu -p no:cacheprovider -rf >"$OUT/tests.log" 2>&1
echo "tests at $SECONDS s: $(grep -E "passed|failed|error" "$OUT/tests.log" | tail -n 1)"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 20
acc=docs/gpu-runs/run44/accuracy.py
(PYTHONPATH=$PWD:${PYTHONPATH:-} timeout 60 python3 $acc new
 cd /tmp/old && PYTHONPATH=/tmp/old:${PYTHONPATH:-} EXLCLI_KERNEL_CACHE=/tmp/old/build/kernels timeout 60 python3 $acc old
) 2>&1 | grep -E "^(new|old) |Error|error" | tee "$OUT/accuracy.txt"
ab=docs/gpu-runs/run41/decode_ab.py
for _ in 1 2; do
  [ "$SECONDS" -gt 480 ] && break
  timeout 100 python3 $ab new --runs "${DECODE_RUNS:-fp8:1+2}"
  (cd /tmp/old && EXLCLI_KERNEL_CACHE=/tmp/old/build/kernels timeout 100 python3 $ab old --runs "${DECODE_RUNS:-fp8:1+2}")
done 2>&1 | grep -E "^(new|old) |Error|error" | tee "$OUT/decode_ab.txt"
echo "done at $SECONDS s"
