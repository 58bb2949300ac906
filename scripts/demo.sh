#!/usr/bin/env bash
# The main job on the embedded offline model (sets itself up first; idempotent).
# With a display: the explorer with a sample prompt. Without one: `rakv generate` on it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PROMPT=${RAKV_PROMPT:-$'def is_prime(n):\n    """Return True if n is a prime number, else False."""'}
if [ -n "${DISPLAY:-}${WAYLAND_DISPLAY:-}" ] && .venv/bin/python -c "import app" 2>/dev/null && [ "${1:-}" != "--cli" ]; then
  exec .venv/bin/rakv-explorer --target demo --draft int8 --prompt "$PROMPT" --autorun
fi
exec .venv/bin/rakv generate --target demo --draft int8 --prompt "$PROMPT" --max-new-tokens 64
