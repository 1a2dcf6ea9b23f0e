#!/usr/bin/env bash
# Run 45's device call, from the repository root, with run 44's four-blocks patch applied to this tree ("new")
# and main in build/ab/old.tar ("old": `git archive HEAD exlcli scripts tests pyproject.toml`). Both builds at
# once, then main's GPU tests; on an H200, issue 15's bench of main (FP8 and 4-bit); on another card, the A/B
# of run 43's next_call.sh (the decode linear alone, then FP8 batch 1 and 2 through the Engine).
set -uo pipefail
cd "$(dirname "$0")/../../.."
source docs/gpu-runs/ab_trees.sh
export PYTHONUNBUFFERED=1
ab_build
(cd /tmp/old && EXLCLI_KERNEL_CACHE=/tmp/old/build/kernels PYTHONPATH=/tmp/old:${PYTHONPATH:-} \
   timeout 200 python3 -m pytest tests/gpu -p no:cacheprovider --timeout 120 -q -rf >"$OUT/main-tests.log" 2>&1)
echo "main's GPU tests at $SECONDS s: $(tail -n 1 "$OUT/main-tests.log")"
case "$(nvidia-smi --query-gpu=name --format=csv,noheader)" in
  *H200*)
    (cd /tmp/old && EXLCLI_KERNEL_CACHE=/tmp/old/build/kernels PYTHONPATH=/tmp/old:${PYTHONPATH:-} \
       timeout $((585 - SECONDS)) python3 scripts/gpu_bench.py --only fp8kv,fp8,q4km,gptq4 \
       --json "$OUT/main-bench.json" 2>&1 | tee "$OUT/main-bench.log" | tail -n 40)
    exit 0 ;;
esac
decode_ab 420 490
