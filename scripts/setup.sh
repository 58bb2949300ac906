#!/usr/bin/env bash
# Idempotent set-up: a virtual env in .venv, torch (unless one is already importable there), the
# project (editable) and its test/bench extras.
#
# torch, when the venv has none (RAKV_TORCH overrides the requirement, default torch==2.13.0):
#   * no nvidia-smi on PATH (a CPU-only machine): the CPU build, from the PyTorch CPU wheel index
#     (https://download.pytorch.org/whl/cpu; first a 15 s reachability check, then pip with a 15 s
#     timeout and one retry). If that index cannot be reached (or the install from it fails), the
#     default index (pip's own configuration) is used instead, and a message says so: there a
#     CPU-only Linux machine gets the CUDA build unless a CPU wheel is configured (a find-links
#     folder or a local index, as on our CI machines).
#   * nvidia-smi on PATH: the default index, i.e. the CUDA build.
# A user who already has torch in the chosen python keeps it: set RAKV_PYTHON to that python to
# build the venv with --system-site-packages instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${RAKV_PYTHON:-python3}
TORCH=${RAKV_TORCH:-torch==2.13.0}
CPU_INDEX=https://download.pytorch.org/whl/cpu
say() { echo "[setup] $*" >&2; }
if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import torch" >/dev/null 2>&1 && [ -n "${RAKV_PYTHON:-}" ]; then
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
VPY=.venv/bin/python
stamp=.venv/.rakv-setup-$(cat pyproject.toml scripts/setup.sh | (sha1sum 2>/dev/null || shasum) | cut -c1-12)
if [ -f "$stamp" ]; then exit 0; fi
$VPY -m pip install -q --upgrade pip >/dev/null 2>&1 || true

cpu_index_reachable() {   # a 15 s look at the index itself, so pip's own retries never stall setup
  $VPY - "$CPU_INDEX/torch/" <<'PY' >/dev/null 2>&1
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=15).close()
PY
}

install_torch() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    say "NVIDIA GPU found (nvidia-smi): installing $TORCH from the default index (CUDA build)"
    $VPY -m pip install -q "$TORCH"
    return
  fi
  if cpu_index_reachable; then
    say "no NVIDIA GPU (no nvidia-smi): installing the CPU build of $TORCH from $CPU_INDEX"
    if $VPY -m pip install -q --timeout 15 --retries 1 --index-url "$CPU_INDEX" "$TORCH"; then
      return
    fi
    say "installing from the PyTorch CPU index failed; trying the default index"
  else
    say "no NVIDIA GPU, but the PyTorch CPU index ($CPU_INDEX) cannot be reached: installing $TORCH"
    say "from the default index (pip's configuration) instead"
  fi
  $VPY -m pip install -q "$TORCH"
}

if ! $VPY -c "import torch" >/dev/null 2>&1; then
  # numpy first: a torch imported without it warns "Failed to initialize NumPy"
  $VPY -m pip install -q numpy
  install_torch
fi
$VPY -c "import torch; print('[setup] torch', torch.__version__, '(CUDA ' + str(torch.version.cuda) + ')' if torch.version.cuda else '(CPU build)')" >&2
# said only when it happened: a CPU-only machine that got the CUDA build (the index had no CPU wheel)
if ! command -v nvidia-smi >/dev/null 2>&1 && $VPY -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
  say "note: this is torch's CUDA build (several GB; it runs on CPU too): the index pip used has no CPU wheel"
fi
$VPY -m pip install -q -e ".[test,bench]"
# the explorer's window on Linux needs a few X11 libraries Qt does not ship (libxcb-icccm4, ...):
# say which are missing and how to install them; never a reason to fail the setup
if [ "$(uname -s)" = Linux ]; then
  $VPY -m app.desktop || say "could not check the explorer's system libraries"
fi
touch "$stamp"
