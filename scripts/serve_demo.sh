#!/usr/bin/env bash
# `exlcli serve` in a real terminal (tmux): one server with its live display on top, and below it
# two `exlcli chat` sessions and an `exlcli batch` job, all attached to that server. Checks that the
# server's display shows the two chats and the batch job at the same time, prints the captured
# screen, then stops the server with Ctrl-C (it drains) and prints PASS/FAIL for each step.
#
#   scripts/serve_demo.sh            # the fake echo engine (about 20 seconds)
#   scripts/serve_demo.sh --real     # the real default model (minutes on a CPU)
#   KEEP_PANES=dir scripts/serve_demo.sh   # also write the captured server screens to dir/
set -u
cd "$(dirname "$0")/.."

MODE=fake
[ "${1:-}" = "--real" ] && MODE=real
SESSION="exlcli-serve-demo-$$"
PYTHON="${PYTHON:-python3}"
FAILED=0
WORK="$(mktemp -d)"
PORT="$($PYTHON -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
URL="http://127.0.0.1:$PORT"
# The demo's server records itself in a private runtime folder, never the user's.
ENV="EXLCLI_RUNTIME_DIR=$WORK/runtime"

cleanup() {
    tmux kill-session -t "$SESSION" 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT

if [ "$MODE" = fake ]; then
    MODEL="fake:echo:0.1"  # 100 ms per token: answers stream for a while
    CHAT_OPTS=""
    LOAD_TIMEOUT=30; RUN_TIMEOUT=60
    CHAT_A="$(printf 'a%d ' $(seq 1 120))"
    CHAT_B="$(printf 'b%d ' $(seq 1 120))"
    for i in $(seq 1 12); do
        printf '{"id": "job-%d", "prompt": "%s", "max_tokens": 200}\n' "$i" "$(printf "j$i-%d " $(seq 1 40))"
    done > "$WORK/batch.jsonl"
else
    MODEL=""
    CHAT_OPTS="--max-tokens 200"
    LOAD_TIMEOUT=300; RUN_TIMEOUT=600
    CHAT_A="Write a long story about a dragon who learns to bake bread."
    CHAT_B="Explain, step by step and in detail, how a bicycle gear works."
    for i in $(seq 1 12); do
        printf '{"id": "job-%d", "messages": [{"role": "user", "content": "Write a short poem about the number %d."}], "max_tokens": 120}\n' "$i" "$i"
    done > "$WORK/batch.jsonl"
fi
MODEL_ARG=""
[ -n "$MODEL" ] && MODEL_ARG="--model $MODEL"

server_pane() { tmux capture-pane -p -J -t "$SESSION:0.0"; }

keep() {
    [ -n "${KEEP_PANES:-}" ] && mkdir -p "$KEEP_PANES" && server_pane > "$KEEP_PANES/$1.txt"
    return 0
}

wait_until() {  # wait_until SECONDS COMMAND...: until COMMAND succeeds
    local end=$((SECONDS + $1)); shift
    while [ $SECONDS -lt $end ]; do
        "$@" && return 0
        sleep 0.2
    done
    return 1
}

check() {  # check NAME COMMAND...: print PASS/FAIL
    local name="$1"; shift
    if "$@"; then echo "PASS  $name"; else echo "FAIL  $name"; FAILED=1; fi
}

# Rows of the "active requests" table, by client label.
active_rows() { server_pane | sed -n '/active requests/,/recently finished/p' | grep -cE "^ *[^ ]+ +$1 +([^ ]+ +)?(waiting|prefill|decode|preempted) "; }
all_three_live() { [ "$(active_rows chat)" -ge 2 ] && [ "$(active_rows batch)" -ge 1 ]; }
server_up() { curl -sf "$URL/health" >/dev/null 2>&1; }
batch_done() { tmux capture-pane -p -J -t "$SESSION:0.3" | grep -q 'batch: .*->'; }

command -v tmux >/dev/null || { echo "FAIL  tmux is not installed"; exit 1; }
echo "mode: $MODE, server at $URL"
tmux new-session -d -s "$SESSION" -x 180 -y 56 \
    "cd $(pwd) && env $ENV $PYTHON -m exlcli serve $MODEL_ARG --port $PORT; echo \"[serve exited with status \$?]\"; sleep 600"
check "server starts and answers /health" wait_until "$LOAD_TIMEOUT" server_up

tmux split-window -v -l 16 -t "$SESSION:0.0" \
    "cd $(pwd) && env $ENV $PYTHON -m exlcli chat --server $URL $CHAT_OPTS; sleep 600"
tmux split-window -h -t "$SESSION:0.1" \
    "cd $(pwd) && env $ENV $PYTHON -m exlcli chat --server $URL $CHAT_OPTS; sleep 600"
chat_ready() { tmux capture-pane -p -t "$SESSION:0.$1" | grep -q '^>>> '; }
both_ready() { chat_ready 1 && chat_ready 2; }
check "both chats attach and show their prompt" wait_until 60 both_ready
tmux send-keys -t "$SESSION:0.1" -l "$CHAT_A"; tmux send-keys -t "$SESSION:0.1" Enter
tmux send-keys -t "$SESSION:0.2" -l "$CHAT_B"; tmux send-keys -t "$SESSION:0.2" Enter
tmux split-window -h -t "$SESSION:0.2" \
    "cd $(pwd) && env $ENV $PYTHON -m exlcli batch $WORK/batch.jsonl -o $WORK/out.jsonl --server $URL --max-in-flight 4; sleep 600"

check "the live display shows two chats and the batch job at once" wait_until "$RUN_TIMEOUT" all_three_live
keep 1-together
echo "---- server display, all three clients live ----"
server_pane | grep -v '^$' | head -40
echo "------------------------------------------------"

check "the batch job finishes" wait_until "$RUN_TIMEOUT" batch_done
nothing_active() { server_pane | grep -q '(none)'; }
check "every request finishes (no active rows left)" wait_until "$RUN_TIMEOUT" nothing_active
pages_free() { curl -sf "$URL/metrics" | grep -qE '^exlcli_kv_pages_used 0(\.0)?$'; }
check "/metrics shows no page in use" pages_free
keep 2-finished

tmux send-keys -t "$SESSION:0.0" C-c
check "Ctrl-C drains and stops the server (status 0)" wait_until 30 eval \
    "tmux capture-pane -p -J -S -200 -t $SESSION:0.0 | grep -q '^\[serve exited with status 0\]'"
if [ $FAILED -eq 0 ]; then echo "PASS  serve tmux demo ($MODE)"; else echo "FAIL  serve tmux demo ($MODE)"; fi
exit $FAILED
