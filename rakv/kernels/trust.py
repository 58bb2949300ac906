"""Native code and pickles in the cache dir run only if this machine's user put them there.

A compiled kernel is loaded with ``dlopen`` and a pickle runs code when read: either, planted in the
cache dir by anyone else, would run in the user's process. So a file of that kind is trusted only
when all of these hold:

- its folder is a real directory (not a link) owned by this user and not writable by group or
  others (``private_dir`` creates it 0700, and tightens one this user owns, dropping every record
  made while others could write there);
- the file is a regular file (not a link) owned by this user, not writable by group or others;
- its SHA-256 equals the one recorded when this program wrote it (``record``, in the folder's
  ``TRUST_FILE``).

Anything else is not loaded: the caller builds (or writes) it again and records the new hash.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

TRUST_FILE = ".rakv-trust.json"      # {file name: {"sha256": hex, "size": bytes}}
LOOSE = stat.S_IWGRP | stat.S_IWOTH


def _uid() -> int | None:
    return os.getuid() if hasattr(os, "getuid") else None


def dir_problem(folder: Path) -> str | None:
    """Why ``folder`` cannot hold trusted files (None when it can)."""
    try:
        st = os.lstat(folder)
    except OSError as e:
        return f"{folder}: {e.strerror or e}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{folder} is not a directory"
    uid = _uid()
    if uid is not None and st.st_uid != uid:
        return f"{folder} is owned by another user (uid {st.st_uid})"
    if st.st_mode & LOOSE:
        return f"{folder} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def private_dir(folder: Path) -> Path:
    """``folder`` created 0700 (its parents as usual); one this user owns is tightened to 0700.
    OSError when it is not fit to hold trusted files (``dir_problem``)."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass
    try:
        st = os.lstat(folder)
        if stat.S_ISDIR(st.st_mode) and (_uid() is None or st.st_uid == _uid()) and st.st_mode & 0o077:
            os.chmod(folder, 0o700)
            if st.st_mode & LOOSE:          # others could write here: no record made before counts
                (folder / TRUST_FILE).unlink(missing_ok=True)
    except OSError:
        pass
    why = dir_problem(folder)
    if why:
        raise OSError(why)
    return folder


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _records(folder: Path) -> dict:
    try:
        d = json.loads((folder / TRUST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return d if isinstance(d, dict) else {}


def record(path: Path) -> None:
    """Record ``path``'s hash as one this program wrote (call right after writing it)."""
    from ..util.paths import write_atomic

    path = Path(path)
    recs = _records(path.parent)
    recs[path.name] = {"sha256": sha256(path), "size": path.stat().st_size}
    write_atomic(path.parent / TRUST_FILE, json.dumps(recs, indent=1))
    os.chmod(path.parent / TRUST_FILE, 0o600)


def forget(path: Path) -> None:
    """Drop ``path``'s record (the file is about to be replaced or was found untrusted)."""
    from ..util.paths import write_atomic

    path = Path(path)
    recs = _records(path.parent)
    if recs.pop(path.name, None) is not None:
        try:
            write_atomic(path.parent / TRUST_FILE, json.dumps(recs, indent=1))
        except OSError:
            pass


def untrusted(path: Path) -> str | None:
    """Why ``path`` must not be loaded (None: it is the file this program recorded, in a private
    folder). A missing file is a reason too."""
    path = Path(path)
    why = dir_problem(path.parent)
    if why:
        return why
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"{path.name}: {e.strerror or e}"
    if not stat.S_ISREG(st.st_mode):
        return f"{path.name} is not a regular file"
    uid = _uid()
    if uid is not None and st.st_uid != uid:
        return f"{path.name} is owned by another user (uid {st.st_uid})"
    if st.st_mode & LOOSE:
        return f"{path.name} is writable by group or others"
    rec = _records(path.parent).get(path.name)
    if not isinstance(rec, dict) or not isinstance(rec.get("sha256"), str):
        return f"{path.name} was not built by this program here (no record of it)"
    try:
        if rec.get("size") != st.st_size or sha256(path) != rec["sha256"]:
            return f"{path.name} is not the file built here (its hash differs from the record)"
    except OSError as e:
        return f"{path.name}: {e.strerror or e}"
    return None
