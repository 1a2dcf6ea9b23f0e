#!/usr/bin/env bash
# Run 40's device call, from the repository root. First, here:
#   mkdir -p build/ab && git show <main before>:exlcli/csrc/quant_gemv_dp4a.cuh > build/ab/dp4a_old.cuh
#   (and build/ab/quant_linear_u4.cu: the tree's quant_linear.cu with 4 chunks in flight for 16 warps)
# then carry build/ab and .whl. On the device it:
# 1. builds three libraries at once: the tree (new), the tree with main's old dp4a header (old), the tree
#    with quant_linear_u4.cu (u4);
# 2. runs every GPU test on the tree;
# 3. runs norm_ab.py's 32-layer 4-bit chain on the three builds, alternating twice, at 1, 2 and 64 tokens.
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-results-tmp}
mkdir -p "$OUT"
export EXLCLI_KERNEL_CACHE=$PWD/build/kernels
nvidia-smi --query-gpu=name --format=csv,noheader
for v in old u4; do mkdir -p /tmp/$v && cp -r exlcli scripts docs /tmp/$v/; done
cp build/ab/dp4a_old.cuh /tmp/old/exlcli/csrc/quant_gemv_dp4a.cuh
cp build/ab/quant_linear_u4.cu /tmp/u4/exlcli/csrc/quant_linear.cu
load='from exlcli.ops.cuda import loader; print(loader.load(), loader.reason())'
for v in old u4; do
  (cd /tmp/$v && EXLCLI_KERNEL_CACHE=/tmp/$v/build/kernels timeout 200 python3 -c "$load" >"$OUT/$v-build.log" 2>&1) &
done
timeout 200 python3 -c "$load" >"$OUT/new-build.log" 2>&1
wait
echo "builds at $SECONDS s: new $(tail -n 1 "$OUT/new-build.log"), old $(tail -n 1 "$OUT/old-build.log"), u4 $(tail -n 1 "$OUT/u4-build.log")"
timeout 120 python3 -m pytest tests/gpu -p no:cacheprovider -rf >"$OUT/tests.log" 2>&1
echo "tests at $SECONDS s: $(grep -E "passed|failed|error" "$OUT/tests.log" | tail -n 1)"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 20
ab=docs/gpu-runs/run38/norm_ab.py
for _ in 1 2; do
  timeout 60 python3 $ab new 1,2,64
  for v in old u4; do (cd /tmp/$v && EXLCLI_KERNEL_CACHE=/tmp/$v/build/kernels timeout 60 python3 $ab $v 1,2,64); done
done 2>&1 | grep -v Warn | tee "$OUT/chain_ab.txt"
echo "done at $SECONDS s"
