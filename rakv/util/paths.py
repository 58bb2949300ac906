"""Where the engine keeps things, and how it writes them: the cache dir, atomic writes, the log line.

The bottom of the import graph: every layer that stores a converted model, a kernel build, a cost
profile or a kernel choice uses these, and none of them imports anything of the project.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path


def replace_atomic(path: Path, fill) -> None:
    """``fill(tmp)`` writes a temporary file beside ``path``, which then replaces ``path`` whole
    (a reader never sees it half-written; on any error the temporary file is removed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        fill(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_atomic(path: Path, text: str) -> None:
    replace_atomic(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def env_on(name: str) -> bool:
    """A switch that is on unless the environment sets ``name`` to 0 / false / off / no."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "off", "no")


def env_text(name: str, default: str = "") -> str:
    """The environment's value of ``name`` (``default`` when unset). The environment is read here and
    in ``rakv.integrations`` only: every setting a user gives that way passes through this module."""
    return os.environ.get(name, default)


def set_env(name: str, value: str, keep: bool = False) -> None:
    """Set ``name`` for this process and its children (``keep``: only where it is not set yet)."""
    if keep:
        os.environ.setdefault(name, value)
    else:
        os.environ[name] = value


def child_env(extra: dict | None = None) -> dict:
    """The environment a child process gets: this process's, with ``extra``."""
    return {**os.environ, **(extra or {})}


def log(msg: str) -> None:
    print(f"[rakv] {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """Where converted models and cost profiles live (``RAKV_CACHE`` overrides)."""
    env = env_text("RAKV_CACHE")
    if env:
        p = Path(env)
    else:
        from platformdirs import user_cache_dir

        p = Path(user_cache_dir("rakv"))
    p.mkdir(parents=True, exist_ok=True)
    return p
