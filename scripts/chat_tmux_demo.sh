#!/usr/bin/env bash
# `exlcli chat` in a real terminal (tmux): type a message, see the streamed answer and the stats
# line, `/n 3`, Ctrl-C in the middle of an answer, `/bye`. Checks the captured panes and prints
# PASS/FAIL for each step; exits 0 only if every check passed.
#
#   scripts/chat_tmux_demo.sh            # against the fake echo engine (a few seconds)
#   scripts/chat_tmux_demo.sh --real     # against the real default model, in-process
#   KEEP_PANES=dir scripts/chat_tmux_demo.sh   # also write each captured pane to dir/
set -u
cd "$(dirname "$0")/.."

MODE=fake
[ "${1:-}" = "--real" ] && MODE=real
SESSION="exlcli-chat-demo-$$"
PYTHON="${PYTHON:-python3}"
FAILED=0
WORK="$(mktemp -d)"

cleanup() {
    tmux kill-session -t "$SESSION" 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT

if [ "$MODE" = fake ]; then
    # 50 ms per token, so there is time to see streaming and to press Ctrl-C mid-answer.
    CHAT="EXLCLI_CACHE=$WORK $PYTHON -m exlcli chat --model fake:echo:0.05"
    LOAD_TIMEOUT=20; ANSWER_TIMEOUT=20
    FIRST_MESSAGE="Hello from tmux, please echo this"
    FIRST_EXPECT="echo: Hello from tmux, please echo this"
    N_MESSAGE="pick a number"
    LONG_MESSAGE="$(printf 'w%d ' $(seq 1 200))"
else
    CHAT="$PYTHON -m exlcli chat --local --max-tokens 200 --temperature 0.7"
    LOAD_TIMEOUT=180; ANSWER_TIMEOUT=180
    FIRST_MESSAGE="What is the capital of France? Answer in one sentence."
    FIRST_EXPECT="Paris"
    N_MESSAGE="Give me a name for a cat, one word."
    LONG_MESSAGE="Write a long story about a dragon who learns to bake bread."
fi

pane() { tmux capture-pane -p -J -S -2000 -t "$SESSION"; }

keep() {  # save the pane under a name when KEEP_PANES is set
    [ -n "${KEEP_PANES:-}" ] && mkdir -p "$KEEP_PANES" && pane > "$KEEP_PANES/$1.txt"
    return 0
}

wait_for() {  # wait_for PATTERN SECONDS [COUNT]: until PATTERN (grep -E) is on COUNT pane lines
    local pattern="$1" seconds="$2" count="${3:-1}" end=$((SECONDS + $2))
    while [ $SECONDS -lt $end ]; do
        [ "$(pane | grep -cE -- "$pattern")" -ge "$count" ] && return 0
        sleep 0.1
    done
    return 1
}

check() {  # check NAME COMMAND...: print PASS/FAIL
    local name="$1"; shift
    if "$@"; then echo "PASS  $name"; else echo "FAIL  $name"; FAILED=1; fi
}

stats_lines() { pane | grep -cE '[0-9]+ prompt tokens \([0-9]+ cached\), first token [0-9.]+ m?s, [0-9]+ tokens at [0-9.]+ tok/s'; }

command -v tmux >/dev/null || { echo "FAIL  tmux is not installed"; exit 1; }
echo "mode: $MODE ($CHAT)"
tmux new-session -d -s "$SESSION" -x 110 -y 40 \
    "cd $(pwd) && $CHAT; echo \"[chat exited with status \$?]\"; sleep 600"

# 1. the banner and the prompt
check "chat starts and shows its prompt" wait_for '^>>> ' "$LOAD_TIMEOUT"

# 2. a message: the answer streams (seen part-way), then the stats line
tmux send-keys -t "$SESSION" -l "$FIRST_MESSAGE"; tmux send-keys -t "$SESSION" Enter
if [ "$MODE" = fake ]; then
    check "answer is seen while streaming" wait_for '^echo: Hello' "$ANSWER_TIMEOUT"
    partial_ok() { ! pane | grep -q "^$FIRST_EXPECT\$" || [ "$(stats_lines)" -eq 0 ]; }
    check "it was caught before it finished" partial_ok
fi
check "stats line after the answer" wait_for 'prompt tokens \([0-9]+ cached\), first token .* tok/s' "$ANSWER_TIMEOUT"
check "the answer is there" wait_for "$FIRST_EXPECT" 1
keep 1-first-answer

# 3. /n 3: three answers in one batch, one after another
tmux send-keys -t "$SESSION" -l "/n 3 $N_MESSAGE"; tmux send-keys -t "$SESSION" Enter
check "/n 3 shows three answers" wait_for 'kept answer 1 in the conversation' "$ANSWER_TIMEOUT"
three_headers() { for k in 1 2 3; do pane | grep -qE "^answer $k of 3 \(seed [0-9]+\)" || return 1; done; }
check "/n 3 answers are labelled 1, 2, 3 with their seeds" three_headers
check "/n 3 each answer has its stats line" test "$(stats_lines)" -ge 4
if [ "$MODE" = fake ]; then
    distinct_seeds() { [ "$(pane | grep -oE '^echo: pick a number \(seed [0-9]+\)' | sort -u | wc -l)" -eq 3 ]; }
    check "/n 3 answers differ (different seeds)" distinct_seeds
fi
keep 2-n3

# 4. Ctrl-C in the middle of a long answer: the answer stops, the chat stays
tmux send-keys -t "$SESSION" -l "$LONG_MESSAGE"; tmux send-keys -t "$SESSION" Enter
if [ "$MODE" = fake ]; then
    wait_for '^echo: w1 w2 w3' "$ANSWER_TIMEOUT"
else
    sleep 3  # let the model write a few lines (a 200-token answer takes ~7 s on 2 cores)
fi
tmux send-keys -t "$SESSION" C-c
check "Ctrl-C stops the answer" wait_for 'tok/s, stopped$' 20
check "the partial answer is kept" wait_for 'stopped; the partial answer is kept' 5
if [ "$MODE" = fake ]; then
    not_finished() { pane | grep -E '^echo: w1 ' | grep -qv 'w200'; }
    check "the answer did not run to its end" not_finished
fi
check "the prompt is back after Ctrl-C" wait_for '^>>> ' 5 4
keep 3-ctrl-c

# 5. the chat still answers, then /bye leaves
tmux send-keys -t "$SESSION" -l "/stats"; tmux send-keys -t "$SESSION" Enter
check "/stats after Ctrl-C" wait_for '^this chat: [0-9]+ answers' 10
tmux send-keys -t "$SESSION" -l "/bye"; tmux send-keys -t "$SESSION" Enter
check "/bye leaves with status 0" wait_for '^\[chat exited with status 0\]' 20
keep 4-bye

echo "---- last screen ----"
pane | grep -v '^$' | tail -25
echo "---------------------"
if [ $FAILED -eq 0 ]; then echo "PASS  chat tmux demo ($MODE)"; else echo "FAIL  chat tmux demo ($MODE)"; fi
exit $FAILED
