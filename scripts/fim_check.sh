#!/bin/bash
# Editor completion on the Qwen2.5-Coder pair (docs/serve.md#editors-fill-in-the-middle): starts
# `rakv serve`, sends the `add` example as llama.vim does (a warm-up, the fill, a keystroke), as a
# completion with `suffix`, and with llama.vim's line rules, prints the answers, stops the server.
# `--llama` sends the same requests to llama.cpp's llama-server on the same GGUF instead.
#   bash scripts/fim_check.sh [--llama] [PORT]      (TARGET / DRAFT: another pair for rakv serve)
set -euo pipefail
PEER=rakv
if [ "${1:-}" = "--llama" ]; then PEER=llama; shift; fi
PORT=${1:-8765}
OUT=$(mktemp -d)
if [ "$PEER" = llama ]; then
    LS=${LLAMA_SERVER:-$HOME/.cache/rakv/llama.cpp/0.3.36/build/bin/llama-server}
    "$LS" -m "$HOME/.cache/rakv/models/presets/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf" --port "$PORT" \
        -t "${THREADS:-2}" --temp 0 > "$OUT/serve.out" 2> "$OUT/serve.err" &
else
    rakv serve --target "${TARGET:-qwen-coder-1.5b}" --draft "${DRAFT:-qwen-coder-0.5b}" --port "$PORT" --parallel 1 \
        > "$OUT/serve.out" 2> "$OUT/serve.err" &
fi
PID=$!
trap 'kill $PID 2>/dev/null || true; wait $PID 2>/dev/null || true; tail -8 "$OUT/serve.err"' EXIT
for _ in $(seq 1 600); do curl -sf "localhost:$PORT/v1/models" > /dev/null && break; sleep 1; done

infill() {   # LINE N_PREDICT [extra JSON fields]
    curl -s "localhost:$PORT/infill" -d "{\"input_prefix\": \"def add(a, b):\\n\", \"input_suffix\": \"\\n\",
        \"prompt\": \"$1\", \"n_predict\": $2, \"temperature\": 0, \"cache_prompt\": true ${3:-}}" | python3 -c '
import json, sys
r = json.load(sys.stdin)
t = r["timings"]
print(repr(r["content"]), "| tokens_cached", r.get("tokens_cached"), "| cache_n", t.get("cache_n"), "prompt_n",
      t["prompt_n"], "%.1f ms" % t["prompt_ms"], "| predicted_n", t["predicted_n"], "%.1f ms" % t["predicted_ms"])'
}
echo "--- warm-up (n_predict 0)";        infill "    return " 0
echo "--- the fill";                      infill "    return " 16
echo "--- a keystroke: '    return a'";   infill "    return a" 16
echo "--- llama.vim's line rules (n_indent 4, t_max_predict_ms 1000, input_extra)"
infill "    return " 64 ', "n_indent": 4, "t_max_predict_ms": 1000, "input_extra": [{"filename": "ops.py", "text": "def sub(a, b):\n    return a - b\n"}]'
if [ "$PEER" = rakv ]; then
    echo "--- /v1/completions with suffix"
    curl -s "localhost:$PORT/v1/completions" \
        -d '{"prompt": "def add(a, b):\n    return ", "suffix": "\n", "max_tokens": 16}' | python3 -c '
import json, sys
r = json.load(sys.stdin)
print(repr(r["choices"][0]["text"]), r["choices"][0]["finish_reason"], "| hit", r["rakv"]["hit_tokens"])'
fi
