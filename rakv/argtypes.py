"""Checked argparse types and path checks shared by ``rakv``, ``rakv bench`` and ``rakv-explorer``.

Every numeric flag is validated while the command line is parsed (before any model loads), so a
bad value gives one line naming the flag. Output paths are checked against the inputs (a command
never overwrites its own input) and for writability, also before anything slow happens.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``prog: error: ...``), exit 2, no usage dump."""

    def error(self, message):
        self.exit(2, f"{self.prog.split()[0]}: error: {message} (see {self.prog} --help)\n")


def _type(name: str, fn):
    fn.__name__ = name          # argparse names the type in "invalid <name> value" messages
    return fn


def finite_float(lo: float = 0.0):
    """A finite float >= lo (inf and nan rejected)."""
    def conv(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(x) or x < lo:
            raise argparse.ArgumentTypeError(f"must be a finite number >= {lo:g}, got {text!r}")
        return x
    return _type("number", conv)


def int_range(lo: int = 1, hi: int | None = None):
    """An integer in [lo, hi] (hi None: no upper bound)."""
    def conv(text: str) -> int:
        try:
            x = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if x < lo or (hi is not None and x > hi):
            rng = f">= {lo}" if hi is None else f"from {lo} to {hi}"
            raise argparse.ArgumentTypeError(f"must be an integer {rng}, got {text!r}")
        return x
    return _type("integer", conv)


def max_threads() -> int:
    """The rule for --threads: 1 to the number of cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def threads(text: str) -> int:
    return int_range(1, max_threads())(text)


threads.__name__ = "integer"


def policy(text: str) -> str:
    from .config import Policy

    try:
        return Policy.parse(text).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


policy.__name__ = "policy"


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """True when two paths name the same file (resolved; hard links too when both exist)."""
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    try:
        if pa.exists() and pb.exists():
            return os.path.samefile(pa, pb)
    except OSError:
        pass
    return pa.resolve() == pb.resolve()


def refuse_overwrite(out: str | os.PathLike, flag: str, inputs: dict) -> None:
    """Raise ValueError when the output path ``out`` is one of the inputs ({flag: path})."""
    for in_flag, path in inputs.items():
        if path and same_file(out, path):
            raise ValueError(f"{flag} {out} is the same file as {in_flag}; refusing to overwrite an input")


def check_writable_file(path: str | os.PathLike, flag: str) -> None:
    """Raise ValueError unless ``path`` can be created or overwritten as a file (checked up front)."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise ValueError(f"{flag} {path} is a directory")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: directory {parent} does not exist")
    if p.exists() and not os.access(p, os.W_OK):
        raise ValueError(f"{flag} {path} is not writable")
    if not p.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: directory {parent} is not writable")


def warn(prog: str, msg: str) -> None:
    print(f"{prog}: warning: {msg}", file=sys.stderr, flush=True)
