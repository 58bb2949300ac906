"""An exclusive inter-process lock on a file in the cache dir (one-time fetch/convert, calibration).

``fcntl.flock`` on Linux and macOS (released by the OS if the holder dies), ``msvcrt.locking`` on
Windows; where neither works (e.g. a file system without locks) it degrades to no lock, which is
what the code did before: the atomic renames still keep every file whole.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from pathlib import Path
from typing import Callable, Iterator

try:
    import fcntl
except ImportError:      # Windows
    fcntl = None
try:
    import msvcrt
except ImportError:      # POSIX
    msvcrt = None


def _try_lock(fd: int) -> bool:
    """Take the lock without blocking; True when held (or when locks are unsupported)."""
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        elif msvcrt is not None:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        return e.errno not in HELD     # otherwise locks are not supported here: go on unlocked


HELD = {errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK, getattr(errno, "EDEADLK", errno.EAGAIN)}


def _unlock(fd: int) -> None:
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
        elif msvcrt is not None:
            os.lseek(fd, 0, 0)
            msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
    except OSError:
        pass


@contextlib.contextmanager
def file_lock(path: str | os.PathLike, on_wait: Callable[[], None] | None = None,
              poll_s: float = 0.2) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if needed). ``on_wait()`` is called once if another
    process holds it. A lock file that cannot be created (read-only dir) means no lock."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        waited = False
        while not _try_lock(fd):
            if not waited and on_wait is not None:
                on_wait()
            waited = True
            time.sleep(poll_s)
        yield
    finally:
        _unlock(fd)
        os.close(fd)
