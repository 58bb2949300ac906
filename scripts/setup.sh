#!/usr/bin/env bash
# Idempotent set-up: a virtual env in .venv with the CPU build of torch (unless a torch is
# already importable there), the project (editable) and its test/bench extras.
# A user who already has torch in the chosen python keeps it: set RAKV_PYTHON to that python
# to build the venv with --system-site-packages instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${RAKV_PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import torch" >/dev/null 2>&1 && [ -n "${RAKV_PYTHON:-}" ]; then
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
VPY=.venv/bin/python
stamp=.venv/.rakv-setup-$(cat pyproject.toml | (sha1sum 2>/dev/null || shasum) | cut -c1-12)
if [ -f "$stamp" ]; then exit 0; fi
$VPY -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! $VPY -c "import torch" >/dev/null 2>&1; then
  # CPU build of torch: never pull a multi-GB CUDA build onto a CPU-only machine.
  if command -v nvidia-smi >/dev/null 2>&1; then
    $VPY -m pip install -q torch
  else
    $VPY -m pip install -q torch==2.13.0
  fi
fi
$VPY -m pip install -q -e ".[test,bench]"
touch "$stamp"
