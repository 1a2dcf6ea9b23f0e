#!/usr/bin/env bash
# KV cache quantization quality beside llama.cpp (issue #52): perplexity and mean KLD against the
# bf16 cache, the default model, >= 16k tokens scored in chunks of its full 8k context (the second
# half of each chunk scored, as llama-perplexity does).
#
#   bash scripts/kv_quant_accuracy.sh                                  # exlcli's types
#   LLAMA_BIN=/path/to/llama.cpp/build/bin bash scripts/kv_quant_accuracy.sh   # and llama-perplexity's
#
# The text: the license texts Debian's base-files package ships (GPL-3, GPL-2, LGPL-2.1, MPL-2.0,
# Apache-2.0, GFDL-1.3: 130,810 bytes, 28,625 tokens of SmolLM2's tokenizer), since no public-domain
# text of that length is shipped by an installed package here (tests/data/opticks-excerpt.txt and the
# tvm_ffi Opticks are under 9k tokens). CHUNKS=2 scores 2 x 4,095 tokens of 16,384; CHUNKS=3 uses 24,576.
set -euo pipefail
MODEL=${MODEL:-$HOME/.cache/exlcli/models/SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${OUT:-/tmp/kv_quant_accuracy}
TEXT=${TEXT:-$OUT/licenses.txt}
CHUNKS=${CHUNKS:-2}
mkdir -p "$OUT"
[ -f "$TEXT" ] || cat /usr/share/common-licenses/{GPL-3,GPL-2,LGPL-2.1,MPL-2.0,Apache-2.0,GFDL-1.3} > "$TEXT"
common=(-f "$TEXT" -m "$MODEL" -c 8192 --chunks "$CHUNKS" --dtype bfloat16 --device cpu)

exlcli perplexity "${common[@]}" --save-logits "$OUT/base.bin" | tee "$OUT/bf16.txt"
for kv in f16 q8_0 q4_0 q4h q3h q8_0,q4_0 q8_0,q4h q4h,q3h; do
    exlcli perplexity "${common[@]}" --kv-cache-dtype "$kv" --kl-divergence "$OUT/base.bin" > "$OUT/$kv.txt"
    echo "== $kv"; tail -n 12 "$OUT/$kv.txt"
done

if [ -n "${LLAMA_BIN:-}" ]; then  # a CPU build; a quantized V cache needs flash attention
    lp=("$LLAMA_BIN/llama-perplexity" -m "$MODEL" -c 8192 --chunks "$CHUNKS" -fa on -t "$(nproc)")
    "${lp[@]}" -f "$TEXT" --kl-divergence-base "$OUT/llama_base.bin" > "$OUT/llama_f16.txt" 2>&1
    for pair in q8_0:q8_0 q4_0:q4_0 q8_0:q4_0; do
        "${lp[@]}" -ctk "${pair%%:*}" -ctv "${pair#*:}" --kl-divergence-base "$OUT/llama_base.bin" --kl-divergence \
            > "$OUT/llama_${pair/:/_}.txt" 2>&1
        echo "== llama.cpp $pair"; grep -E "Mean +KLD|Mean PPL|Same top" "$OUT/llama_${pair/:/_}.txt"
    done
fi
