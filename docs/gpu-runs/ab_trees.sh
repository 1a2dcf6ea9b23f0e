# Sourced by a device call's script, from the repository root, to compare this tree ("new") with main before
# it ("old": build/ab/old.tar, made here with `git archive <rev> exlcli scripts > build/ab/old.tar`, carried
# with build/ab). ab_build extracts the old tree to /tmp/old and builds both libraries at once; both_trees
# LIMIT SCRIPT ARGS runs a python SCRIPT with "new", then in the old tree with "old", each in its own
# process, the repository root first on PYTHONPATH and its own kernel cache.
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
