#!/usr/bin/env bash
# A screenshot of the explorer watching a real vLLM server (docs/gui.md, "Watching a vLLM server").
# Run on 2026-12-06 (docs/gui.md, the shot in docs/img/vllm-watch.png). Starts vLLM's OpenAI
# server from the vLLM venv on CPU with vLLM's own n-gram speculation (k = 4) and prefix caching,
# waits for /health, sends a few requests (copy-heavy, so n-gram drafts get accepted, and a
# repeated prompt, so the prefix cache hits), launches the explorer under Xvfb pointed at it and
# grabs the screen with ImageMagick's `import -window root`.
#
#   scripts/vllm_watch_shot.sh MODEL_DIR [PROFILE.json]
#
# MODEL_DIR: a model folder vLLM loads (docs/vllm.md). PROFILE: a vLLM cost profile
# (`rakv calibrate --engine vllm --target MODEL_DIR --out PROFILE`) for the crossover lines.
# Env: VLLM_VENV (default /work/vllm-venv), PORT (8011), DISPLAY_NUM (97), OUT (docs/img/vllm-watch.png).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:?usage: scripts/vllm_watch_shot.sh MODEL_DIR [PROFILE.json]}
PROFILE=${2:-}
VLLM_VENV=${VLLM_VENV:-/work/vllm-venv}
PORT=${PORT:-8011}
DNUM=${DISPLAY_NUM:-97}
OUT=${OUT:-docs/img/vllm-watch.png}
PY=${PY:-.venv/bin/python}
URL="http://127.0.0.1:$PORT"
mkdir -p "$(dirname "$OUT")"
LOG=$(mktemp -d)/vllm.log
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

# 1. vLLM (CPU), n-gram speculation of 4 tokens, prefix caching on
VLLM_CPU_OMP_THREADS_BIND=auto "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server \
  --model "$MODEL" --port "$PORT" --host 127.0.0.1 --max-model-len 2048 --enable-prefix-caching \
  --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}' \
  >"$LOG" 2>&1 &
pids+=($!)
echo "vllm: starting (log $LOG) ..."
for _ in $(seq 1 600); do
  curl -sf "$URL/health" >/dev/null && break
  kill -0 "${pids[0]}" 2>/dev/null || { echo "vllm exited:"; tail -30 "$LOG"; exit 1; }
  sleep 1
done
curl -sf "$URL/health" >/dev/null || { echo "vllm: no /health after 600 s"; exit 1; }

# 2. the explorer under Xvfb, watching it (it polls once a second; the shot is taken by import below)
Xvfb ":$DNUM" -screen 0 1500x940x24 >/dev/null 2>&1 &
pids+=($!)
sleep 2
ARGS=(--watch-vllm "$URL" --size 1500x940)
[ -n "$PROFILE" ] && ARGS+=(--vllm-profile "$PROFILE")
DISPLAY=":$DNUM" RAKV_SETTINGS="$(mktemp -d)/s.ini" "$PY" -m app.main "${ARGS[@]}" &
pids+=($!)
sleep 8

# 3. a few requests while it watches: a copy task (n-gram drafts accepted) and repeated prompts (cache hits)
MODEL_NAME=$(curl -s "$URL/v1/models" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
TEXT="def area(r):\n    return 3.14159 * r * r\n\ndef perimeter(r):\n    return 2 * 3.14159 * r\n"
for i in 1 2 3 4 5 6; do
  curl -s "$URL/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$MODEL_NAME\", \"prompt\": \"Copy this code exactly:\\n$TEXT\\nCopy:\\n\", \"max_tokens\": 64, \"temperature\": 0}" >/dev/null
  sleep 2
done

# 4. the shot
sleep 3
DISPLAY=":$DNUM" import -window root "$OUT"
echo "screenshot: $OUT"
