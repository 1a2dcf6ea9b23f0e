#!/bin/bash
# exlcli vs llama.cpp on this machine's CPU, side by side in one run, on the same GGUF files: decode at
# batch 1 (llama-bench tg128 / exlcli bench tg128 -np 1), at 16 streams (llama-batched-bench -npl 16 /
# exlcli bench -np 16), prefill (pp512), and perplexity (llama-perplexity / exlcli perplexity, same
# file, same text, same -c and --chunks).
#
# usage: LLAMA_BIN=/path/to/llama.cpp/build/bin bash scripts/cpu_vs_llamacpp.sh [GGUF...]
#   Without files: the default model (Q4_1) and its Q4_K_M requantization (made with llama-quantize
#   --allow-requantize beside it in $WORK unless there already).
# env: THREADS (2), REPS (3), TEXT (a text file for perplexity; default /usr/share/common-licenses/GPL-3),
#      CTX (512), CHUNKS (8), WORK (/tmp/cpu_vs_llamacpp: results and the requantized file), SKIP_PPL (1: no ppl)
#
# Building llama.cpp as the comparison wants it (the llama-cpp-python source package's vendored tree):
#   python3 -m pip download --no-deps --no-binary=:all: llama-cpp-python && tar xf llama_cpp_python-*.tar.gz
#   cd llama_cpp_python-*/vendor/llama.cpp && F="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
#   cmake -B build -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DCMAKE_C_FLAGS="$F" \
#         -DCMAKE_CXX_FLAGS="$F" && cmake --build build -j2 --target llama-bench llama-batched-bench \
#         llama-quantize llama-perplexity
# (-mno-amx-*: these VMs report AMX but cannot run it; GGML_NATIVE=ON builds for the CPU it runs on.)
set -eu
: "${LLAMA_BIN:?set LLAMA_BIN to the build/bin folder of llama.cpp}"
THREADS=${THREADS:-2}; REPS=${REPS:-3}; CTX=${CTX:-512}; CHUNKS=${CHUNKS:-8}
TEXT=${TEXT:-/usr/share/common-licenses/GPL-3}; WORK=${WORK:-/tmp/cpu_vs_llamacpp}
mkdir -p "$WORK"
say() { echo "[$(date +%T)] $*" >&2; }
EXLCLI=(python3 -m exlcli)

files=("$@")
if [ ${#files[@]} -eq 0 ]; then
    default=$(python3 -c "from exlcli.hub.default_model import resolve_model_path; print(resolve_model_path(None))")
    q4km="$WORK/$(basename "${default%.Q4_1.gguf}").Q4_K_M.gguf"
    if [ ! -f "$q4km" ]; then
        say "llama-quantize --allow-requantize $default -> $q4km (Q4_K_M)"
        "$LLAMA_BIN/llama-quantize" --allow-requantize "$default" "$q4km" Q4_K_M > "$WORK/quantize.log" 2>&1
    fi
    files=("$q4km" "$default")
fi

for f in "${files[@]}"; do
    tag=$(basename "$f" .gguf)
    say "$tag: llama-bench pp512 tg128 (-t $THREADS -r $REPS)"
    "$LLAMA_BIN/llama-bench" -m "$f" -p 512 -n 128 -t "$THREADS" -r "$REPS" -o json > "$WORK/$tag.llama-bench.json" \
        2> "$WORK/$tag.llama-bench.err"
    say "$tag: exlcli bench pp512, tg128 -np 1,16"  # two runs: pp512 at 16 streams is not compared
    "${EXLCLI[@]}" bench -m "$f" -p 512 -n 0 -np 1 -t "$THREADS" -r "$REPS" --format json \
        > "$WORK/$tag.exlcli-pp.json" 2> "$WORK/$tag.exlcli-pp.err"
    "${EXLCLI[@]}" bench -m "$f" -p 0 -n 128 -np 1,16 -t "$THREADS" -r "$REPS" --format json \
        > "$WORK/$tag.exlcli-tg.json" 2> "$WORK/$tag.exlcli-tg.err"
    say "$tag: llama-batched-bench npp 128 ntg 128 npl 1,16"
    "$LLAMA_BIN/llama-batched-bench" -m "$f" -c 4608 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 1,16 -t "$THREADS" \
        --output-format jsonl > "$WORK/$tag.llama-batched.jsonl" 2>&1  # its log and the rows (lines of JSON)
    if [ "${SKIP_PPL:-0}" != 1 ]; then
        say "$tag: perplexity -c $CTX --chunks $CHUNKS on $TEXT"
        "$LLAMA_BIN/llama-perplexity" -m "$f" -f "$TEXT" -c "$CTX" --chunks "$CHUNKS" -t "$THREADS" \
            > "$WORK/$tag.llama-ppl.out" 2>&1 || true
        EXLCLI_CPU_THREADS=$THREADS "${EXLCLI[@]}" perplexity "$TEXT" -m "$f" -c "$CTX" --chunks "$CHUNKS" \
            > "$WORK/$tag.exlcli-ppl.out" 2>&1 || true
    fi
done

python3 - "$WORK" "${files[@]}" <<'EOF'
import json, os, re, sys

work, files = sys.argv[1], sys.argv[2:]


def llama_bench(tag):
    rows = json.load(open(f"{work}/{tag}.llama-bench.json"))
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0)
    return pp, tg


def batched(tag, npl):
    for line in open(f"{work}/{tag}.llama-batched.jsonl"):
        if line.startswith("{"):
            r = json.loads(line)
            if r.get("pl") == npl:
                return r["speed_tg"]
    return float("nan")


def exl(tag):
    rows = json.load(open(f"{work}/{tag}.exlcli-pp.json")) + json.load(open(f"{work}/{tag}.exlcli-tg.json"))
    get = lambda test, b: next(r for r in rows if r["test"] == test and r["batch"] == b)  # noqa: E731
    return get("pp512", 1)["tps_mean"], get("tg128", 1), get("tg128", 16)


def ppl(path, pattern):
    if not os.path.exists(path):
        return "-"
    m = re.findall(pattern, open(path, errors="replace").read())
    return m[-1] if m else "-"


print("| file | test | llama.cpp t/s | exlcli t/s | exlcli / llama.cpp | exlcli read/step, % of copy bw |")
print("|---|---|---:|---:|---:|---|")
for f in files:
    tag = os.path.basename(f).removesuffix(".gguf")
    lpp, ltg = llama_bench(tag)
    epp, etg1, etg16 = exl(tag)
    l16 = batched(tag, 16)
    for test, lv, ev, row in (("decode, batch 1 (tg128)", ltg, etg1["tps_mean"], etg1),
                              ("decode, 16 streams (tg128)", l16, etg16["tps_mean"], etg16),
                              ("prefill (pp512)", lpp, epp, None)):
        bw = (f"{row['bytes_per_step'] / 2**20:.1f} MiB, {100 * row['bandwidth_frac']:.0f}%"
              if row and row.get("bandwidth_frac") else "-")
        print(f"| {tag} | {test} | {lv:.1f} | {ev:.1f} | {ev / lv:.2f}x | {bw} |")
print()
print("| file | llama-perplexity | exlcli perplexity |")
print("|---|---|---|")
for f in files:
    tag = os.path.basename(f).removesuffix(".gguf")
    lp = ppl(f"{work}/{tag}.llama-ppl.out", r"Final estimate: PPL = ([\d.]+ \+/- [\d.]+)")
    ep = ppl(f"{work}/{tag}.exlcli-ppl.out", r"Final estimate: PPL = ([\d.]+ \+/- [\d.]+)")
    print(f"| {tag} | {lp} | {ep} |")
EOF
