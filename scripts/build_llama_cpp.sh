#!/usr/bin/env bash
# Build llama.cpp's bench tools (llama-bench, llama-speculative-simple,
# llama-completion or llama-cli) and its server (llama-server) from the
# llama.cpp vendored in the llama-cpp-python sdist, for `rakv bench
# --peer-llama-cpp` and `rakv bench --load` (continuous batching, -np N).
#
#   bash scripts/build_llama_cpp.sh [VERSION]      (default 0.3.36)
#
# Output: ~/.cache/rakv/llama.cpp/<VERSION>/build/bin (or $RAKV_CACHE/llama.cpp/...).
# Idempotent: a second run with the binaries present does nothing.
# Env: PYTHON (default python3), JOBS (default 2), RAKV_CACHE (rakv's cache dir).
set -euo pipefail
VERSION="${1:-${LLAMA_CPP_PYTHON_VERSION:-0.3.36}}"
PY="${PYTHON:-python3}"
JOBS="${JOBS:-2}"
CACHE="${RAKV_CACHE:-$HOME/.cache/rakv}"
ROOT="$CACHE/llama.cpp/$VERSION"
BIN="$ROOT/build/bin"

# AMX off unless RAKV_LLAMA_AMX=1: on a 2-core Xeon VM that reports amx_tile/amx_int8 (2026-12-06),
# llama.cpp's AMX matmul (used for prompt eval, batches > 1) died with SIGILL on `tilezero`, while
# llama-bench's decode-only test ran; with -march=native the compiler enables AMX wherever the CPU
# reports it, so it is switched off explicitly (decode, the weight repacking and AVX-512 stay).
CFLAGS_EXTRA=""
if [ "$(uname -m)" = "x86_64" ] && [ "${RAKV_LLAMA_AMX:-0}" != "1" ]; then
  CFLAGS_EXTRA="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
STAMP="native;${CFLAGS_EXTRA}"

have_all() {
  [ -x "$BIN/llama-bench" ] && [ -x "$BIN/llama-speculative-simple" ] && [ -x "$BIN/llama-server" ] &&
    { [ -x "$BIN/llama-completion" ] || [ -x "$BIN/llama-cli" ]; }
}
if have_all && [ "$(cat "$ROOT/build/rakv-build-flags" 2>/dev/null)" = "$STAMP" ]; then
  echo "llama.cpp $VERSION already built: $BIN"
  exit 0
fi

mkdir -p "$ROOT"
cd "$ROOT"
SDIST="$(ls llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)"
if [ -z "$SDIST" ]; then
  echo "[build_llama_cpp] downloading llama-cpp-python==$VERSION sdist" >&2
  "$PY" -m pip download --no-deps --no-binary :all: --dest "$ROOT" \
    "llama-cpp-python==$VERSION" >&2
  SDIST="$(ls llama_cpp_python-"$VERSION".tar.gz)"
fi
SRC="$ROOT/src"
if [ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]; then
  echo "[build_llama_cpp] unpacking $SDIST" >&2
  rm -rf "$SRC" "$ROOT/unpack"
  mkdir -p "$ROOT/unpack"
  tar -xzf "$SDIST" -C "$ROOT/unpack"
  mv "$ROOT/unpack"/llama_cpp_python-"$VERSION" "$SRC"
  rmdir "$ROOT/unpack"
fi
LC="$SRC/vendor/llama.cpp"
echo "[build_llama_cpp] configuring $LC" >&2
cmake -S "$LC" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON \
  -DCMAKE_C_FLAGS="$CFLAGS_EXTRA" -DCMAKE_CXX_FLAGS="$CFLAGS_EXTRA" >&2
# which completion tool this version has: llama-completion (newer) or llama-cli
TARGETS="llama-bench llama-speculative-simple llama-server"
# (newer llama.cpp's llama-cli is the chat client built on the server: llama-completion is the
# plain one-shot tool there; the source tree says which exists)
if [ -f "$LC/tools/completion/CMakeLists.txt" ] && grep -q 'llama-completion' "$LC/tools/completion/CMakeLists.txt"; then
  TARGETS="$TARGETS llama-completion"
else
  TARGETS="$TARGETS llama-cli"
fi
echo "[build_llama_cpp] building: $TARGETS (-j$JOBS)" >&2
# shellcheck disable=SC2086
cmake --build "$ROOT/build" --config Release -j"$JOBS" --target $TARGETS >&2
if ! have_all; then
  echo "build_llama_cpp: build finished but binaries are missing in $BIN" >&2
  exit 1
fi
echo "$VERSION" > "$ROOT/VERSION"
echo "$STAMP" > "$ROOT/build/rakv-build-flags"
echo "llama.cpp $VERSION built: $BIN"
