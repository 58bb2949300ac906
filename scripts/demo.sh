#!/usr/bin/env bash
# The main job on the embedded offline model (sets itself up first; idempotent).
# With a display: the explorer with a sample prompt. Without one: `rakv generate` on it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# A copy-friendly prompt: the answer repeats most of the function, so the n-gram draft (the demo's
# default) finds its tokens in the prompt and the controller drafts (k > 0); RAKV_PROMPT sets another.
PROMPT=${RAKV_PROMPT:-$'Rename n to number in this function and return the whole function:\n\ndef is_prime(n):\n    if n < 2:\n        return False\n    for i in range(2, int(n ** 0.5) + 1):\n        if n % i == 0:\n            return False\n    return True'}
if [ -n "${DISPLAY:-}${WAYLAND_DISPLAY:-}" ] && .venv/bin/python -c "import app" 2>/dev/null && [ "${1:-}" != "--cli" ]; then
  exec .venv/bin/rakv-explorer --target demo --draft ngram --prompt "$PROMPT" --autorun
fi
exec .venv/bin/rakv generate --target demo --draft ngram --prompt "$PROMPT" --max-new-tokens 64
