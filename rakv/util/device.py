"""Devices: ``--device auto|cpu|cuda|mps`` resolution, a synchronizing clock, and the CPU's ISA flags.

Every timing point in the engine reads ``clock()``: on CPU it is ``time.perf_counter``; once a
model has been placed on an asynchronous device (CUDA, MPS) it first waits for that device's queued
work, so a timer never stops before the kernels it times have run.
"""

from __future__ import annotations

import os
import platform
import sys
import time

import torch

DEVICES = ("auto", "cpu", "cuda", "mps")

_perf = time.perf_counter
_async: set[str] = set()     # device types in use that run asynchronously (cuda, mps)


class DeviceError(ValueError):
    """The requested device does not exist here; the message is one clear line."""


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def available() -> dict[str, bool]:
    return {"cpu": True, "cuda": bool(torch.cuda.is_available()), "mps": _mps_available()}


def resolve(name: str | None) -> str:
    """``auto`` -> cuda if available, else mps, else cpu; an explicit device must be available.

    Accepts an index (``cuda:1``). Raises ``DeviceError`` with one clear line otherwise.
    """
    s = (name or "auto").strip().lower()
    kind, _, index = s.partition(":")
    if kind not in DEVICES:
        raise DeviceError(f"unknown device {name!r} (expected one of {', '.join(DEVICES)})")
    if index and (kind not in ("cuda",) or not index.isdigit()):
        raise DeviceError(f"bad device {name!r} (an index is only for cuda, e.g. cuda:0)")
    av = available()
    if kind == "auto":
        return "cuda" if av["cuda"] else "mps" if av["mps"] else "cpu"
    if not av[kind]:
        why = {"cuda": "torch.cuda.is_available() is False: no CUDA GPU, or a CPU-only torch build "
                       f"({torch.__version__})",
               "mps": "torch.backends.mps.is_available() is False (MPS needs Apple silicon and macOS 12.3+)"}[kind]
        raise DeviceError(f"device {kind!r} is not available here: {why}")
    if index and int(index) >= torch.cuda.device_count():
        raise DeviceError(f"device {s!r} is not available here: {torch.cuda.device_count()} CUDA device(s)")
    return s


def register(device) -> None:
    """Note that a model lives on ``device``; from now on ``clock()`` synchronizes it."""
    kind = torch.device(device).type
    if kind in ("cuda", "mps"):
        _async.add(kind)


def sync(device=None) -> None:
    """Wait for queued work on ``device`` (default: every asynchronous device in use); no-op on CPU."""
    kinds = _async if device is None else {torch.device(device).type}
    for kind in kinds:
        if kind == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize()
        elif kind == "mps" and _mps_available():
            torch.mps.synchronize()


def clock() -> float:
    """``time.perf_counter()`` after synchronizing the devices in use (CPU only: no sync)."""
    if _async:
        sync()
    return _perf()


def model_device(model) -> torch.device:
    dev = getattr(model, "device", None)
    if isinstance(dev, torch.device):
        return dev
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def isa_flags() -> list[str]:
    """The SIMD / matrix ISA extensions this CPU reports (from /proc/cpuinfo; empty if unknown)."""
    interesting = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                   "avx512_vnni", "avx512_bf16", "avx_vnni", "avx_ne_convert", "amx_tile", "amx_bf16",
                   "amx_int8", "asimd", "sve", "sve2", "neon")
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags.update(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return [x for x in interesting if x in flags]


def threads_info() -> dict:
    return {"torch_threads": torch.get_num_threads(), "cores": os.cpu_count(),
            "torch_capability": torch.backends.cpu.get_cpu_capability()
            if hasattr(torch.backends, "cpu") and hasattr(torch.backends.cpu, "get_cpu_capability") else ""}


def hardware_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform()}


def versions_info() -> dict:
    import torch
    import transformers

    from .. import __version__

    return {"rakv": __version__, "python": sys.version.split()[0], "torch": torch.__version__,
            "transformers": transformers.__version__}
