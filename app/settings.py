"""All persistent settings in one place, over QSettings.

``RAKV_SETTINGS`` (an .ini path) overrides the platform store; tests pass a temporary file.
Sessions (recordings of live runs) go to ``RAKV_SESSIONS`` or the user data dir.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from PySide6.QtCore import QByteArray, QSettings

from rakv.config import DEFAULT_K_SET, DEMO_DRAFT, Policy, parse_k_set
from rakv.config import default_draft as rakv_default_draft

MAX_RECENT = 8
DEFAULT_PROMPT = ("Explain in two sentences why caching the key and value states of a prompt "
                  "makes a repeated request faster.")


def sessions_dir() -> Path:
    env = os.environ.get("RAKV_SESSIONS")
    if env:
        p = Path(env)
    else:
        from platformdirs import user_data_dir

        p = Path(user_data_dir("rakv-explorer")) / "sessions"
    p.mkdir(parents=True, exist_ok=True)
    return p


def _ok(check, v) -> bool:
    try:
        return bool(check(v))
    except (TypeError, ValueError):
        return False


VALID = {      # what a stored value must satisfy to be used
    "models/target": lambda v: isinstance(v, str) and v.strip(),
    "models/draft": lambda v: isinstance(v, str) and v.strip(),
    "run/prompt": lambda v: isinstance(v, str),
    "run/policy": lambda v: isinstance(v, str) and Policy.parse(v),
    "run/max_new_tokens": lambda v: 1 <= v <= 4096,
    "controls/budget_mib": lambda v: math.isfinite(v) and v >= 0,
    "controls/k_set": lambda v: parse_k_set(str(v)),
    "controls/granularity": lambda v: v in ("request", "round"),
    "controls/sampling": lambda v: isinstance(v, str) and sampling_from_text(v) is not None,
    "replay/speed": lambda v: isinstance(v, str),
}


class Settings:
    """Typed accessors; every value has its default here."""

    DEFAULTS = {
        "models/target": "demo",
        "models/draft": DEMO_DRAFT,      # the demo target's default draft (rakv.config.default_draft)
        "run/prompt": DEFAULT_PROMPT,
        "run/policy": "adaptive",
        "run/max_new_tokens": 256,            # lets a code answer finish (issue 44)
        "run/raw": False,                 # True: prompts go in as they are (no chat template)
        "run/conversation": False,        # True: each Run is the next turn of one conversation
        "controls/budget_mib": 512,
        "controls/k_set": ",".join(map(str, DEFAULT_K_SET)),
        "controls/granularity": "round",
        "controls/sampling": "{}",        # JSON of rakv.config.Sampling's fields ({} = greedy)
        "replay/speed": "2x",
    }

    def __init__(self, path: str | os.PathLike | None = None):
        path = path or os.environ.get("RAKV_SETTINGS")
        if path:
            self.q = QSettings(str(path), QSettings.Format.IniFormat)
        else:
            self.q = QSettings("RAKV", "RAKV Explorer")

    # ------------------------------------------------------------------ scalars
    def get(self, key: str):
        default = self.DEFAULTS.get(key)
        v = self.q.value(key, default)
        if isinstance(default, bool):         # an .ini store gives "true" / "false" back
            return v if isinstance(v, bool) else str(v).strip().lower() in ("true", "1", "yes")
        if isinstance(default, int) and not isinstance(v, int):
            try:
                v = int(float(v))
            except (TypeError, ValueError, OverflowError):
                v = self._bad(key, v)
        check = VALID.get(key)
        if check is not None and v != default and not _ok(check, v):
            v = self._bad(key, v)
        return v

    def _bad(self, key: str, v):
        """A stored value that cannot be used: the default, with a warning (never a failed start)."""
        default = self.DEFAULTS.get(key)
        print(f"rakv-explorer: warning: ignoring the saved setting {key}={v!r} (using {default!r})",
              file=sys.stderr)
        return default

    def set(self, key: str, value) -> None:
        self.q.setValue(key, value)

    # ------------------------------------------------------------------ restored values, reset
    def non_defaults(self) -> dict:
        """The stored settings (of DEFAULTS) whose values differ from the defaults: key -> value."""
        return {k: self.get(k) for k in self.DEFAULTS
                if self.q.contains(k) and not same_value(k, self.get(k), self.DEFAULTS[k])}

    def reset(self) -> None:
        """Every setting of DEFAULTS back to its default (recent lists and the window layout stay)."""
        for k in self.DEFAULTS:
            self.q.remove(k)
        self.q.sync()

    # ------------------------------------------------------------------ lists
    def _list(self, key: str) -> list[str]:
        v = self.q.value(key, [])
        if isinstance(v, str):
            v = [v] if v else []
        return [str(x) for x in (v or [])]

    def _push(self, key: str, item: str) -> None:
        items = [x for x in self._list(key) if x != item]
        self.q.setValue(key, ([item] + items)[:MAX_RECENT])

    def recent_models(self, role: str) -> list[str]:
        return self._list(f"models/recent_{role}")

    def add_recent_model(self, role: str, spec: str) -> None:
        self._push(f"models/recent_{role}", spec)

    def recent_recordings(self) -> list[str]:
        return [p for p in self._list("recent/recordings") if Path(p).exists()]

    def add_recent_recording(self, path: str) -> None:
        self._push("recent/recordings", str(Path(path).resolve()))

    # ------------------------------------------------------------------ a watched vLLM server
    def vllm_url(self) -> str:
        """The last vLLM server watched ("" if none)."""
        v = self.q.value("vllm/url", "")
        return v if isinstance(v, str) else ""

    def set_vllm_url(self, url: str) -> None:
        self.q.setValue("vllm/url", str(url))

    def vllm_profile(self) -> str:
        """The last vLLM cost profile used for the crossover ("" if none)."""
        v = self.q.value("vllm/profile", "")
        return v if isinstance(v, str) else ""

    def set_vllm_profile(self, path: str) -> None:
        self.q.setValue("vllm/profile", str(Path(path).resolve()))

    # ------------------------------------------------------------------ window
    def geometry(self) -> tuple[QByteArray | None, QByteArray | None]:
        """The saved window geometry and dock state (None each where there is none, or a value that
        is not one: ignored with a warning, the default layout used)."""
        out = []
        for key in ("window/geometry", "window/state"):
            v = self.q.value(key)
            if v is not None and not isinstance(v, (QByteArray, bytes, bytearray)):
                print(f"rakv-explorer: warning: ignoring the saved setting {key} (not a saved layout)", file=sys.stderr)
                v = None
            out.append(v)
        return out[0], out[1]

    def save_geometry(self, geometry: QByteArray, state: QByteArray) -> None:
        self.q.setValue("window/geometry", geometry)
        self.q.setValue("window/state", state)

    def sync(self) -> None:
        self.q.sync()


GENERIC_DRAFTS = ("int8", "ngram", "none")     # drafts made for any target (its int8 copy, prompt lookup, none)


def default_draft(target: str) -> str:
    """The draft a target gets when none is named: a preset's own draft (qwen-coder-1.5b:
    qwen-coder-0.5b), else the engine's default for it (``rakv.config.default_draft``: the demo's
    n-gram draft, int8 for any other target)."""
    from rakv.load.presets import PRESETS

    p = PRESETS.get(target.strip())
    return p.draft if p is not None and p.draft else rakv_default_draft(target)


def command_line_pair(target: str | None, draft: str | None, shown_target: str,
                      shown_draft: str) -> tuple[str, str, str]:
    """The pair to show after ``--target`` / ``--draft``, given the pair the panels hold (restored
    from the last session): (target, draft, notice). A named target keeps the shown draft only where
    it fits: a draft made for any target (int8, ngram, none), the draft of the same target as before,
    or the target's own draft; any other (another pair's model draft) gives way to the target's
    default draft, and the notice says so ("" when nothing was replaced). A named draft is used as named."""
    t = (target or "").strip() or shown_target
    if (draft or "").strip():
        return t, draft.strip(), ""
    d = shown_draft.strip()
    if not (target or "").strip() or d in GENERIC_DRAFTS or t == shown_target.strip() or d == default_draft(t):
        return t, d, ""
    new = default_draft(t)
    return t, new, (f"draft {new} for --target {t}: the last session's draft {d} went with "
                    f"{shown_target} (--draft names another)")


LABELS = {"models/target": "target", "models/draft": "draft", "run/prompt": "prompt", "run/policy": "policy",
          "run/max_new_tokens": "max new tokens", "run/raw": "raw prompt", "run/conversation": "conversation",
          "controls/budget_mib": "budget", "controls/k_set": "K", "controls/granularity": "granularity",
          "controls/sampling": "sampling", "replay/speed": "replay speed"}


def same_value(key: str, a, b) -> bool:
    """Whether two values of a setting mean the same (K sets and sampling compared as parsed)."""
    if key == "controls/k_set":
        try:
            return parse_k_set(str(a)) == parse_k_set(str(b))
        except ValueError:
            return False
    if key == "controls/sampling":
        return sampling_from_text(str(a)) == sampling_from_text(str(b))
    if key == "controls/budget_mib":
        try:
            return float(a) == float(b)
        except (TypeError, ValueError):
            return False
    return a == b


def describe(key: str, value) -> str:
    """One setting for the status bar's notice: "max new tokens 24", "K {0, 4}", "prompt (edited)"."""
    name = LABELS.get(key, key)
    if key == "run/prompt":
        return "prompt (edited)"
    if isinstance(value, bool):
        return f"{name} {'on' if value else 'off'}"
    if key == "controls/k_set":
        try:
            return "K {" + ", ".join(map(str, parse_k_set(str(value)))) + "}"
        except ValueError:
            return f"K {value}"
    if key == "controls/budget_mib":
        return f"budget {float(value):g} MiB"
    if key == "controls/sampling":
        smp = sampling_from_text(str(value))
        return "sampling " + (f"T {smp.temperature:g}" if smp is not None and not smp.greedy else "greedy")
    return f"{name} {value}"


def sampling_from_text(text: str):
    """The Sampling stored as JSON (None when it is not a valid one)."""
    from rakv.config import Sampling, problem
    from rakv.util.text_in import load_json

    try:
        s = Sampling(**load_json(text))
    except (ValueError, TypeError):
        return None
    return None if problem(s) else s

