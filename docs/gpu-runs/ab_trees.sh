# Sourced by a device call's script, from the repository root, to compare this tree ("new") with main before
# it ("old": build/ab/old.tar, made here with `git archive <rev> exlcli scripts > build/ab/old.tar`, carried
# with build/ab). ab_build extracts the old tree to /tmp/old and builds both libraries at once; both_trees
# LIMIT SCRIPT ARGS runs a python SCRIPT with "new", then in the old tree with "old", each in its own
# process, the repository root first on PYTHONPATH and its own kernel cache. decode_ab ROWS_BY DECODE_BY: run
# 43's A/B, twice each while the call is younger than ROWS_BY / DECODE_BY seconds: run 32's decode_rows.py (the
# decode linear alone, 1-4 rows, e4m3 and bf16, PDL off; rows.txt), then run 41's decode_ab.py (DECODE_RUNS,
# default FP8 batch 1 and 2 through the Engine; decode_ab.txt).
OUT=${OUT:-results-tmp}
mkdir -p "$OUT"
export EXLCLI_KERNEL_CACHE=$PWD/build/kernels

ab_build() {
  nvidia-smi --query-gpu=name --format=csv,noheader
  mkdir -p /tmp/old && tar -xf build/ab/old.tar -C /tmp/old && cp -r docs /tmp/old/
  local load='from exlcli.ops.cuda import loader; print(loader.load(), loader.reason())'
  (cd /tmp/old && EXLCLI_KERNEL_CACHE=/tmp/old/build/kernels timeout 200 python3 -c "$load" >"$OUT/old-build.log" 2>&1) &
  timeout 200 python3 -c "$load" >"$OUT/new-build.log" 2>&1
  wait
  echo "builds at $SECONDS s: new $(tail -n 1 "$OUT/new-build.log"), old $(tail -n 1 "$OUT/old-build.log")"
}

both_trees() {
  local limit=$1 script=$2
  shift 2
  PYTHONPATH=$PWD:${PYTHONPATH:-} timeout "$limit" python3 "$script" new "$@"
  (cd /tmp/old && PYTHONPATH=/tmp/old:${PYTHONPATH:-} EXLCLI_KERNEL_CACHE=/tmp/old/build/kernels \
     timeout "$limit" python3 "$script" old "$@")
}

decode_ab() {
  local rows_by=$1 decode_by=$2
  for _ in 1 2; do
    [ "$SECONDS" -gt "$rows_by" ] && break
    both_trees 90 docs/gpu-runs/run32/decode_rows.py
  done 2>&1 | grep -E "^(new|old) |Error|error" | tee "$OUT/rows.txt"
  echo "rows at $SECONDS s"
  for _ in 1 2; do
    [ "$SECONDS" -gt "$decode_by" ] && break
    both_trees 100 docs/gpu-runs/run41/decode_ab.py --runs "${DECODE_RUNS:-fp8:1+2}"
  done 2>&1 | grep -E "^(new|old) |Error|error" | tee "$OUT/decode_ab.txt"
  echo "done at $SECONDS s"
}
