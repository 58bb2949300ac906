"""The compiled block kernel (``kernels/blockq.c``): built once per machine into the cache dir, loaded
with ctypes, its entry points typed. The compiler is the environment's ``CC`` (a build setting read
through ``rakv.util.paths``), else ``cc``, ``gcc`` or ``clang``."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from ...util.paths import env_text

SOURCE = Path(__file__).parent.parent / "blockq.c"


# ----------------------------------------------------------------------------- the compiled kernel
class _Lib:
    handle = None          # ctypes.CDLL once built and loaded
    reason = ""            # why not, when it could not be
    tried = False
    ident = ""             # the loaded build's identity (source, compiler, CPU)


def _compiler() -> str | None:
    for cc in (env_text("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _build_dir() -> Path:
    from ...util.paths import cache_dir

    return cache_dir() / "kernels"


def _ident(cc: str) -> str:
    """What the built library depends on: the source, the compiler, the CPU it was tuned for."""
    try:
        ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        ver = ""
    from ...util.device import hardware_info

    flags = ""
    try:
        from ...util.device import isa_flags

        flags = " ".join(isa_flags())
    except Exception:  # noqa: BLE001 - the flags only name the build
        pass
    h = hashlib.sha1()
    for part in (SOURCE.read_bytes(), ver.encode(), hardware_info()["cpu"].encode(), flags.encode(),
                 platform.machine().encode(), sys.platform.encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _build(cc: str, out: Path, extra: tuple = (), source: Path = SOURCE) -> str:
    """Compile the kernel (``source``, by default the product's) into ``out`` (atomically); returns
    "" or why it failed. ``extra``: more compiler flags (the tests build the narrower SIMD variants
    with ``-mno-avx512f``, ``-mno-avx2``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    cmd = [cc, "-O3", "-march=native", *extra, "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared",
           "-o", str(tmp), str(source), "-lm"]
    if sys.platform == "darwin":           # Apple clang: OpenMP through torch's libomp is not assumed
        cmd = [c for c in cmd if c != "-fopenmp"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{cc} failed: {e}"
    if r.returncode != 0 or not tmp.exists():
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        tmp.unlink(missing_ok=True)
        return f"{cc} failed: {last}"
    os.replace(tmp, out)
    return ""


def library():
    """The loaded kernel library, building it on first use; None when it cannot be (``reason()``)."""
    if _Lib.tried:
        return _Lib.handle
    _Lib.tried = True
    if not SOURCE.exists():
        _Lib.reason = f"kernel source missing ({SOURCE})"
        return None
    if sys.platform.startswith("win"):
        _Lib.reason = "no C kernel build on Windows"
        return None
    cc = _compiler()
    if cc is None:
        _Lib.reason = "no C compiler (cc, gcc, clang) on PATH"
        return None
    from ...util.filelock import file_lock
    from .. import trust

    ident = _ident(cc)
    out = _build_dir() / f"blockq-{ident}.so"
    if trust.untrusted(out):            # loaded only as built here (rakv/kernels/trust.py)
        try:
            with file_lock(trust.private_dir(out.parent) / f"{out.stem}.lock"):
                if (not_ours := trust.untrusted(out)) and out.exists():
                    print(f"[rakv] not loading {out}: {not_ours}; building it again", file=sys.stderr)
                if not_ours:
                    print("[rakv] building the block-weight kernel (once per machine) ...", file=sys.stderr)
                    why = _build(cc, out)
                    if why:
                        _Lib.reason = why
                        return None
                    trust.record(out)
        except OSError as e:
            _Lib.reason = f"cannot write {out.parent}: {e}"
            return None
    try:
        lib = _load(out)
    except (OSError, AttributeError) as e:      # AttributeError: a library without the kernel's entry points
        _Lib.reason = f"cannot load {out.name}: {e}"
        return None
    _Lib.handle, _Lib.ident = lib, ident
    return lib


def build_id() -> str:
    """The loaded kernel build's identity ("" when there is none): a profile measured with another
    build of the kernel measured another machine."""
    library()
    return _Lib.ident


def _load(path: Path):
    """The built library at ``path`` with its entry points typed."""
    lib = ctypes.CDLL(str(path))
    vp, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.rakv_linear.argtypes = [vp, vp, i64, vp, vp, i32]
    lib.rakv_linear.restype = None
    lib.rakv_attend.argtypes = [vp, i64, i64, i64, i64, vp, i64, vp, i64, i64, i64, ctypes.c_float, vp, i32,
                                i64, ctypes.c_float]
    lib.rakv_attend.restype = None
    lib.rakv_check.argtypes = [vp, vp, i64, i64, i32]
    lib.rakv_check.restype = i64
    lib.rakv_blockq_avx512.restype = i32
    lib.rakv_blockq_simd.restype = i32
    lib.rakv_decode_layers.argtypes = [vp, i64, vp, i64, i64, i64, i64, i64, i64, i64, vp, vp,
                                       ctypes.c_float, ctypes.c_float, i32, vp, i64, vp, vp]
    lib.rakv_decode_layers.restype = i32
    lib.rakv_gumbel_argmax.argtypes = [vp, i64, i64, ctypes.c_float, vp, vp, vp, vp, vp]
    lib.rakv_gumbel_argmax.restype = i32
    lib.rakv_q8act_simd.restype = i32
    return lib


def reason() -> str:
    """Why the kernel is not available ("" when it is, or was not tried yet)."""
    return _Lib.reason
