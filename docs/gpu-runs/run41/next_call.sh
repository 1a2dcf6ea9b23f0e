#!/usr/bin/env bash
# Run 41's device call, from the repository root. First, here:
#   mkdir -p build/ab && git archive <main before> exlcli scripts > build/ab/old.tar
# then carry build/ab and .whl. On the device it:
# 1. builds the tree (new: quant_qkv_rope) and the old tree at once;
# 2. runs every GPU test on the tree;
# 3. runs decode_ab.py on both trees, alternating twice (GPTQ b1 and b2, Q4_K_M b1; DECODE_RUNS: others).
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
ab=docs/gpu-runs/run41/decode_ab.py
for _ in 1 2; do
  [ "$SECONDS" -gt 430 ] && break  # a round takes about a minute or two: stay in the call's 600 s
  timeout 120 python3 $ab new --runs "${DECODE_RUNS:-gptq4:1+2,q4km:1}"
  (cd /tmp/old && EXLCLI_KERNEL_CACHE=/tmp/old/build/kernels timeout 120 python3 $ab old --runs "${DECODE_RUNS:-gptq4:1+2,q4km:1}")
done 2>&1 | grep -E "^(new|old) |Error|error" | tee "$OUT/decode_ab.txt"
echo "done at $SECONDS s"
