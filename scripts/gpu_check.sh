#!/usr/bin/env bash
# On a CUDA machine: build the kernels, run the GPU tests, run the benchmarks, print one table last.
#
#   bash scripts/gpu_check.sh            # everything (about 5 minutes on an H200)
#   GPU_CHECK_HF=0 bash scripts/gpu_check.sh   # without the Hugging Face comparison
#   GPU_CHECK_CPU=0 ...                         # without the CPU kernel tests (CI runs them)
#   GPU_CHECK_BENCH=0 ...                       # build and tests only (a short lease)
#   GPU_CHECK_TEST_S=420 ...                    # the GPU tests' time limit (default 240 s: the whole of tests/gpu
#                                               # takes longer on an H100, so a full run needs more)
#   GPU_CHECK_TESTS="tests/gpu/test_a.py ..."   # those test files only (default: tests/gpu)
#   GPU_BENCH_ARGS="--variants --profile" ...  # more bench options (see scripts/gpu_bench.py)
#
# On the lent device, whose image lacks some of exlcli's pure-Python dependencies, carry the wheels
# scripts/device_wheels.sh downloads and install them before this script (its header says how).
#
# Logs and results go to $OUT (default ./results-tmp): build.log, tests.log, bench.log,
# bench.json, and the built library (so a later run on a fresh machine can skip the build).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results-tmp}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export EXLCLI_KERNEL_CACHE=${EXLCLI_KERNEL_CACHE:-$PWD/build/kernels}
HF=${GPU_CHECK_HF:-1}
DEADLINE=$(( $(date +%s) + ${GPU_CHECK_SECONDS:-570} ))  # the whole script ends by then

echo "== device"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
echo "host compiler: $(${CXX:-c++} --version 2>/dev/null | head -n 1) (CXX=${CXX:-unset})"
[ -n "${CXX:-}" ] && file "$CXX" 2>/dev/null | cut -c1-150 && head -c 600 "$CXX" 2>/dev/null | grep -a -v "^#" | head -n 8

echo "== build (cache: $EXLCLI_KERNEL_CACHE)"
start=$(date +%s)
EXLCLI_VERBOSE_BUILD=1 timeout 420 python3 - >"$OUT/build.log" 2>&1 <<'PY'
from exlcli.ops.backend import kernel_cache_root
from exlcli.ops.cuda import loader
from exlcli.ops.cuda.build import arch_list, build_key, library_name
ok = loader.load()
print("kernels loaded:", ok, loader.reason())
if ok:
    key = build_key(arch_list())
    print("library:", kernel_cache_root() / key / (library_name(key) + ".so"))
raise SystemExit(0 if ok else 1)
PY
build_rc=$?
echo "build rc=$build_rc in $(( $(date +%s) - start )) s"
tail -n 3 "$OUT/build.log"
if [ $build_rc -ne 0 ]; then grep -m 20 -B 2 -A 6 "error" "$OUT/build.log"; fi
cp "$EXLCLI_KERNEL_CACHE"/*/exlcli_kernels_*.so "$OUT"/ 2>/dev/null || true
for so in "$EXLCLI_KERNEL_CACHE"/*/exlcli_kernels_*.so; do
  [ -f "$so" ] || continue
  # the library must use torch's C++ runtime, not a static copy (exceptions crossing it crashed)
  echo "$(basename "$so"): needs $(readelf -d "$so" | grep -o 'lib[a-z_+]*\.so[.0-9]*' | tr '\n' ' ')"
  echo "  defines __cxa_throw itself: $(nm -D --defined-only "$so" 2>/dev/null | grep -c ' __cxa_throw$')"
done

echo "== GPU tests"
start=$(date +%s)
timeout "${GPU_CHECK_TEST_S:-240}" python3 -m pytest ${GPU_CHECK_TESTS:-tests/gpu} -p no:cacheprovider --timeout 120 -rf \
  >"$OUT/tests.log" 2>&1
tests_rc=$?
summary=$(grep -E "passed|failed|error|skipped" "$OUT/tests.log" | tail -n 1)
if [ $tests_rc -eq 124 ]; then  # pytest's progress lines say how far it got
  progress=$(grep -E '^[.FEsxX]+( +\[ *[0-9]+%\])?$' "$OUT/tests.log" | sed 's/ *\[.*//' | tr -d '\n')
  summary="stopped at its ${GPU_CHECK_TEST_S:-240} s limit after ${#progress} tests, $(tr -cd 'FE' <<<"$progress" | wc -c) failed"
fi
echo "tests rc=$tests_rc in $(( $(date +%s) - start )) s: $summary"
grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/tests.log" | head -n 30

if [ "${GPU_CHECK_CPU:-1}" = "1" ]; then
  echo "== CPU kernel tests (the C kernels on this host's CPU)"
  grep -o -m1 "avx512bw" /proc/cpuinfo || echo "this CPU has no AVX-512: some CPU kernel tests skip"
  start=$(date +%s)
  timeout 150 python3 -m pytest tests/ops -p no:cacheprovider --timeout 60 -q -rf >"$OUT/cpu-tests.log" 2>&1
  cpu_rc=$?
  echo "cpu tests rc=$cpu_rc in $(( $(date +%s) - start )) s: $(grep -E "passed|failed|error" "$OUT/cpu-tests.log" | tail -n 1)"
  grep -E "^(FAILED|ERROR)" "$OUT/cpu-tests.log" | head -n 20
fi

echo "== benchmarks"
hf_flag=""
[ "$HF" = "1" ] && hf_flag="--hf"
left=$(( DEADLINE - $(date +%s) ))
if [ "${GPU_CHECK_BENCH:-1}" != "1" ] || [ $left -lt 10 ]; then
  echo "(no bench: GPU_CHECK_BENCH=${GPU_CHECK_BENCH:-1}, $left s left)"  # timeout 0 would mean no limit
  exit $tests_rc
fi
echo "(bench gets $left s)"
timeout $left python3 scripts/gpu_bench.py --json "$OUT/bench.json" --tests "$summary" $hf_flag ${GPU_BENCH_ARGS:-} \
  >"$OUT/bench.log" 2>&1
echo "bench rc=$?"
grep -E "Error|error|Traceback" "$OUT/bench.log" | head -n 10
echo
if [ -f "$OUT/bench.json" ]; then
  python3 scripts/gpu_bench.py --table "$OUT/bench.json" --tests "$summary"
else
  tail -n 20 "$OUT/bench.log"
fi
