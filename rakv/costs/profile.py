"""Cost profiles on disk: machine fingerprints, the file format, validation, where profiles live.

A profile is a JSON file in the cache dir's ``profiles/``, named by a digest of its fingerprint
(CPU model, threads, torch version, device and GPU name, fast path, the model pair, dtype, the
target's numerics and the target's backend's own fingerprint, ``rakv.backend.Backend.fingerprint``:
its kind, numerics, device, threads, C layers on or off, the q8 tiles' form, the kernel build, ISA): a
changed fingerprint means a new calibration. A malformed file is a ``ProfileError`` that names it.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import MISSING as dataclass_missing
from dataclasses import asdict, fields
from pathlib import Path
from typing import Callable

import torch

from ..device import hardware_info
from ..paths import write_atomic
from ..text_in import load_json
from .model import PROFILE_VERSION, CostProfile


def fingerprint(target_key: str, draft_key: str, dtype: str, device: str = "cpu", fast: bool = False) -> dict:
    hw = hardware_info()
    fp = {"cpu": hw["cpu"], "threads": torch.get_num_threads(), "torch": torch.__version__,
          "target": target_key, "draft": draft_key, "dtype": dtype, "version": PROFILE_VERSION,
          "device": device, "fast": bool(fast)}
    if device.startswith("cuda") and torch.cuda.is_available():
        fp["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return fp


def pair_fingerprint(target, draft) -> dict:
    """The fingerprint of this machine and pair as loaded (device and fast path read off the model,
    the backend as chosen at load: a profile measured under one backend is not reused under another)."""
    from ..backend import LeanBackend, backend_of
    from ..device import model_device
    from ..kernels.fastpath import is_enabled, one_row_kernel

    fp = fingerprint(target.key, getattr(draft, "key", "none"), str(next(target.model.parameters()).dtype),
                     device=str(model_device(target.model)), fast=is_enabled(target.model))
    fp["numerics"] = getattr(target, "numerics", "fp32")     # q8 and fp32 steps cost differently: two profiles
    if one_row_kernel(target.model) == "packed":     # a step on the other kernel is another machine
        fp["one_row"] = "packed"
    be = getattr(target, "backend", None) or backend_of(target.model)
    if isinstance(be, LeanBackend):                               # so is a step on the lean forward
        fp["lean"] = True
        if be.lean.c_layers_on():                                 # and one with every layer in C
            fp["c_layers"] = True
    fp["backend"] = be.fingerprint()                              # and one on another backend
    if target.blockq.get("layers"):                               # and one from exact block codes
        from ..kernels.blockq import build_id

        fp["blockq"] = int(target.blockq["layers"])
        fp["kernel"] = build_id()                                 # (another build of them: another machine)
    return fp


def fingerprint_id(fp: dict) -> str:
    return hashlib.blake2b(json.dumps(fp, sort_keys=True).encode(), digest_size=8).hexdigest()


class ProfileError(ValueError):
    """A saved cost profile is unreadable or malformed; the message names the file."""


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _curve(x) -> str | None:
    if not isinstance(x, list):
        return "expected a list of [n, ms] pairs"
    for p in x:
        if not (isinstance(p, list) and len(p) == 2 and all(_num(v) and v >= 0 for v in p)):
            return f"expected [n, ms] pairs of finite numbers >= 0, got {p!r}"[:120]
    return None


def _mapping(x, ok, what: str) -> str | None:
    if not isinstance(x, dict):
        return "expected an object"
    for k, v in x.items():
        if not ok(v):
            return f"{k!r}: expected {what}, got {v!r}"[:120]
    return None


def _v_table(x) -> str | None:
    bad = _mapping(x, lambda v: _num(v) and v > 0, "a finite number > 0")
    if bad is None and not all(isinstance(k, str) and k.isdigit() for k in x):
        return "keys must be k values like \"1\""
    return bad


def _opt_frac(x) -> bool:
    return x is None or (_num(x) and 0 <= x <= 1)


def _like_default(f, x) -> str | None:
    """A field without its own check: the JSON type of its default (None allows anything JSON)."""
    default = f.default_factory() if callable(f.default_factory) else f.default
    if default is None or default is dataclass_missing:
        return None
    want = (int, float) if isinstance(default, (int, float)) and not isinstance(default, bool) else type(default)
    return None if isinstance(x, want) and not (isinstance(x, bool) and want != bool) else \
        f"expected {getattr(want, '__name__', 'a number')}"


def profile_problem(d) -> str | None:
    """Why a loaded JSON object is not a usable profile (None when it is)."""
    if not isinstance(d, dict):
        return "expected a JSON object"
    known = {f.name: f for f in fields(CostProfile)}
    unknown = sorted(set(d) - set(known))
    if unknown:
        return f"unknown field {unknown[0]!r}"
    for name in ("T_pf", "t", "V"):
        if name not in d:
            return f"missing field {name!r}"
    version = d.get("fingerprint", {}).get("version") if isinstance(d.get("fingerprint"), dict) else None
    if version is not None and version != PROFILE_VERSION:
        return f"profile version {version!r}, this program writes {PROFILE_VERSION}"
    for name, x in d.items():
        check = FIELD_CHECKS.get(name)
        bad = check(x) if check else _like_default(known[name], x)
        if bad:
            return f"field {name!r}: {bad}"
    if not d["T_pf"] or not d["t"]:
        return "no measurements (T_pf or t is empty)"
    return None


def save_learned(profile: CostProfile, cache: Path) -> str | None:
    """Write a profile refined online back where it was loaded from; an error message or None."""
    if not profile.fingerprint or getattr(profile, "read_only", False):
        return None
    try:
        save_profile(profile, profile_path(cache, profile.fingerprint))
    except OSError as e:
        return str(e)
    return None


def quality_summary(profile: CostProfile) -> dict:
    """What says how far to trust a profile (the run header's ``profile``; the explorer shows it):
    contended and why, the spread of each term's repeats, the CPU share, when it was measured."""
    q = profile.quality or {}
    return {"calibrated_at": profile.calibrated_at, "calibration_s": round(float(profile.calibration_s), 1),
            "contended": bool(q.get("contended")), "reasons": list(q.get("reasons", [])),
            "cpu_share": q.get("cpu_share"), "spread": dict(q.get("spread", {})),
            "retries": q.get("retries", 0), "checked": q.get("checked"),
            "id": fingerprint_id(profile.fingerprint) if profile.fingerprint else ""}


def profile_path(cache: Path, fp: dict) -> Path:
    return cache / "profiles" / f"{fingerprint_id(fp)}.json"


def _usable(path: Path, fp: dict, k_max: int, say) -> CostProfile | None:
    try:
        prof = load_profile(path)
    except ProfileError as e:
        say(f"{e}; measuring again")
        return None
    if prof is not None and prof.fingerprint == fp and all(str(k) in prof.V for k in range(1, k_max + 1)):
        return prof
    return None


def saved_profile(target, draft, cache: Path) -> tuple[CostProfile | None, Path]:
    """The saved profile for this machine and pair (None if there is none or it is malformed)."""
    fp = pair_fingerprint(target, draft)
    path = profile_path(cache, fp)
    try:
        prof = load_profile(path)
    except ProfileError as e:
        print(f"[rakv] {e}", file=sys.stderr)
        prof = None
    return prof, path


def _counts(x) -> bool:
    return isinstance(x, list) and all(_num(v) and v >= 0 for v in x)


def _accept_map(x) -> str | None:
    """The gate's per-bin counts ({} before any): {"hits": [...], "n": [...]}, numbers >= 0."""
    if not isinstance(x, dict):
        return "expected an object"
    for key in ("hits", "n"):
        if key in x and not _counts(x[key]):
            return f"{key!r}: expected a list of finite numbers >= 0"
    if set(x) - {"hits", "n"}:
        return f"unknown key {sorted(set(x) - {'hits', 'n'})[0]!r}"[:120]
    return None


def _by_setting(x) -> str | None:
    """Acceptance per sampling setting: {key: {"alpha0": a, "alpha_learned": a, "alpha_trials": n}}."""
    if not isinstance(x, dict):
        return "expected an object"
    for key, v in x.items():
        if not isinstance(v, dict):
            return f"{key!r}: expected an object"[:120]
        for name, ok in (("alpha0", _opt_frac), ("alpha_learned", _opt_frac),
                         ("alpha_trials", lambda t: t is None or (_num(t) and t >= 0))):
            if name in v and not ok(v[name]):
                return f"{key!r}: {name} {v[name]!r} is out of range"[:120]
    return None


def _quality(x) -> str | None:
    """The calibration's quality section, as calibrate and the explorer read it."""
    if not isinstance(x, dict):
        return "expected an object"
    if "spread" in x and _mapping(x["spread"], _num, "a finite number") is not None:
        return "'spread': expected an object of finite numbers"
    if "cpu_share" in x and not (x["cpu_share"] is None or _num(x["cpu_share"])):
        return "'cpu_share': expected a number"
    if "retries" in x and not _num(x["retries"]):
        return "'retries': expected a number"
    if "reasons" in x and not (isinstance(x["reasons"], list) and all(isinstance(r, str) for r in x["reasons"])):
        return "'reasons': expected a list of strings"
    return None


def _regime(x) -> str | None:
    """The machine's regime figures (shown by calibrate): numbers where they are numbers."""
    if not isinstance(x, dict):
        return "expected an object"
    for key in ("floor_ms", "floor5_ms", "step_ms", "step_over_floor", "d_over_t", "d2_over_d", "ctx"):
        if x.get(key) is not None and not _num(x[key]):
            return f"{key!r}: expected a number"
    if "isa" in x and not (isinstance(x["isa"], list) and all(isinstance(f, str) for f in x["isa"])):
        return "'isa': expected a list of strings"
    return None


FIELD_CHECKS: dict[str, Callable[[object], str | None]] = {
    "fingerprint": lambda x: None if isinstance(x, dict) else "expected an object",
    "T_pf": _curve, "D_pf": _curve, "t": _curve, "d": _curve,
    "V": _v_table,
    "d2_ratio": lambda x: None if _num(x) and 0.5 <= x <= 8 else "expected a number in [0.5, 8]",
    "V_ctx": lambda x: None if isinstance(x, int) and not isinstance(x, bool) and x >= 1 else "expected an integer >= 1",
    "clone_ms_per_token": lambda x: None if _num(x) and x >= 0 else "expected a finite number >= 0",
    "lookup_ms": lambda x: None if _num(x) and x >= 0 else "expected a finite number >= 0",
    "alpha0": lambda x: None if _num(x) and 0 <= x <= 1 else "expected a number in [0, 1]",
    "alpha_learned": lambda x: None if _opt_frac(x) else "expected null or a number in [0, 1]",
    "out_frac": lambda x: None if _opt_frac(x) else "expected null or a number in [0, 1]",
    "alpha_trials": lambda x: None if x is None or (_num(x) and x >= 0) else "expected null or a number >= 0",
    "calibrated_at": lambda x: None if isinstance(x, str) else "expected a string",
    "calibration_s": lambda x: None if _num(x) and x >= 0 else "expected a finite number >= 0",
    "scale": lambda x: _mapping(x, lambda v: _num(v) and v > 0, "a finite number > 0"),
    "samples": lambda x: _mapping(x, lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                                  "an integer >= 0"),
    "accept_map": _accept_map, "alpha_by_setting": _by_setting, "quality": _quality, "regime": _regime,
}


def save_profile(profile: CostProfile, path: Path) -> None:
    """Atomic: a unique temp file in the same dir, then os.replace (concurrent saves never collide)."""
    write_atomic(Path(path), json.dumps(asdict(profile), indent=1))


def load_profile(path: Path) -> CostProfile | None:
    """The profile at ``path``; None if there is none; ProfileError if it is malformed."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(f"cannot read cost profile {path}: {e}") from None
    try:
        d = load_json(text)
    except ValueError as e:
        raise ProfileError(f"cost profile {path} is not valid JSON ({e})") from None
    problem = profile_problem(d)
    if problem:
        raise ProfileError(f"cost profile {path} is malformed: {problem}")
    return CostProfile(**d)
