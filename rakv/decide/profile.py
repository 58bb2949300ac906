"""Cost profiles: the measured terms, their interpolation and online refinement, and where and
how a profile is fingerprinted, validated, read and written (one place for all of it; the vLLM
proposer's plain-dict profile is read here too).

A ``CostProfile`` holds medians measured by calibration (``rakv.decide.calibration``) and is
refined online from every measured round:

  T_pf(n)   target prefill of n tokens        (piecewise-linear in n: ``interp``)
  D_pf(n)   draft prefill / catch-up of n tokens
  t(c)      target one-token step at context c (piecewise-linear in c)
  d(c)      draft one-token step at context c
  V(k)      target verify forward over k+1 tokens, per k (no formula: not monotone on CPU),
            scaled with context like t(c)
  clone     prefix-cache clone/store cost per token; lookup cost
  alpha0    acceptance measured during calibration (the controller's prior)

Every prediction is base x machine (x own, for some terms). The machine factor is one scale moved
by every measurement of a term calibration timed in its interleaved rounds loop (t and the rounds
R{k} up to k_max): a slower machine moves all terms together, so the ratios that decide k (V(k)/t,
d/t) stay as calibrated. Terms calibration did not time as the engine pays them (the prefills;
verify lengths past k_max) learn an own scale, bounded, and never move the machine factor. The
evidence for this design is in docs/controller.md.

Where the round records disagree with the calibrated ratios themselves (a profile timed on a busy
machine kept V(8)/t 2-3.6 on the demo, whose quiet rounds pay 1.3-1.6), the machine factor cannot
mend it: each drafting length k also keeps its residual over base x machine (``S{k}`` in ``scale``),
and once that is off by more than its noise it corrects V(k) (a length without rounds of its own
borrows the longest corrected shorter length's; ``shape_correction``; ``corrections``
says which are in force, and every request_end and the explorer's cost line show them).

On disk a profile is a JSON file in the cache dir's ``profiles/``, named by a digest of its
fingerprint (CPU model, threads, torch version, device and GPU name, fast path, the model pair,
dtype, the target's numerics and the target's backend's own fingerprint: its kind, numerics,
device, threads, C layers on or off, the q8 tiles' form, the kernel build, ISA): a changed
fingerprint means a new calibration. A malformed file is a ``ProfileError`` that names it.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import MISSING as dataclass_missing
from dataclasses import asdict, dataclass, field, fields
from fractions import Fraction
from pathlib import Path
from typing import Callable

import torch

from ..util.device import hardware_info
from ..util.paths import write_atomic
from ..util.text_in import load_json
from .learned import OnlineScales
from .policy import round_draft_ms

SHAPE_NOISE = 0.10       # a verify length's round records correct its V(k) only when they are off by more than
                         # this (or twice the term's calibration spread, if larger) ...
SHAPE_MIN_ROUNDS = 8     # ... over at least this many rounds of that length ...
SHAPE_WEIGHT = 0.1       # ... averaged in log space (1/n for the first 1/SHAPE_WEIGHT rounds, then this weight) ...
SHAPE_DRIFT = 4.0        # ... and by at most this factor either way (a busy calibration's V(8)/t 3.6 against 1.3)
PROFILE_VERSION = 12         # 12: V(k) floored at the step it contains
                             # 11: rounds R{k} as one term; own scales only for prefills and lookup lengths
                             # 10: the draft's two-token step (d2_ratio)
                             # 9: the lean forward (its steps; the int8 draft's fused layers); D refined online
                             # 8: V measured past k_max (lookup_vs) for n-gram lookups
                             # 7: the quality section (spread per term, CPU share, contended)
def interp(points: list[list[float]], x: float) -> float:
    """Piecewise-linear through (x, y) points, linear extrapolation, never below 0."""
    if not points:
        return 0.0
    pts = sorted(points)
    if len(pts) == 1:
        x0, y0 = pts[0]
        return max(0.0, y0 * (x / x0 if x0 else 1.0))
    if x <= pts[0][0]:
        (x0, y0), (x1, y1) = pts[0], pts[1]
    elif x >= pts[-1][0]:
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
    else:
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if x0 <= x <= x1:
                break
    slope = (y1 - y0) / (x1 - x0) if x1 != x0 else 0.0
    return max(0.0, y0 + slope * (x - x0))


@dataclass
class CostProfile(OnlineScales):
    fingerprint: dict = field(default_factory=dict)
    T_pf: list[list[float]] = field(default_factory=list)   # [[n, ms], ...]
    D_pf: list[list[float]] = field(default_factory=list)
    t: list[list[float]] = field(default_factory=list)      # [[context, ms], ...]
    d: list[list[float]] = field(default_factory=list)
    V: dict[str, float] = field(default_factory=dict)       # str(k) -> ms at context V_ctx
    V_ctx: int = 128
    # a model draft's first forward after a fully accepted round feeds 2 tokens (the last draft and
    # the target's bonus token): its cost over a 1-token draft step, measured at V_ctx
    d2_ratio: float = 1.0
    clone_ms_per_token: float = 0.0
    lookup_ms: float = 0.0
    alpha0: float = 0.5
    # learned from requests served (the controller writes them; `rakv generate` saves them), so a
    # later session starts from the acceptance and output length this pair actually showed
    alpha_learned: float | None = None
    out_frac: float | None = None
    alpha_trials: float | None = None    # trials behind alpha_learned (capped; bounds exploration)
    # the draft's confidence against acceptance, per bin (rakv.decide.gate): {"hits": [...], "n": [...]}
    accept_map: dict = field(default_factory=dict)
    # acceptance per sampling setting (rakv.decoding.sampling.Sampling.key, not "greedy"): {"alpha0": measured
    # prior, "alpha_learned": long-run rate, "alpha_trials": its evidence}; greedy uses the fields above
    alpha_by_setting: dict = field(default_factory=dict)
    calibrated_at: str = ""
    calibration_s: float = 0.0
    # online refinement: multiplicative scales (log-space EWMA of measured / predicted)
    scale: dict[str, float] = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=dict)
    # how clean the calibration was (rakv/util/meter.py): spread per term, CPU share, retries,
    # curves made monotone, and contended (measured while the machine was busy)
    quality: dict = field(default_factory=dict)

    @property
    def contended(self) -> bool:
        return bool(self.quality.get("contended"))

    def __post_init__(self):
        self._seen: dict[str, int] = {}      # measurements per term in this session (not saved)
    # regime figures of this machine (measured at calibration; see regime_figures)
    regime: dict = field(default_factory=dict)

    # --------------------------------------------------------------- V(k) corrected by round records
    def factor(self, term: str) -> float:
        """The online scale of a term (``OnlineScales.factor``), times a drafting round's shape
        correction (``shape_correction``) for R{k}."""
        f = super().factor(term)
        k = _drafting_k(self, term)
        return f * self.shape_correction(k) if k else f

    def observe(self, term: str, predicted: float, measured: float) -> None:
        """``OnlineScales.observe``, and for a drafting round of k its residual over base x machine
        factor (what the shared factor cannot explain: V(k)'s shape against t) into ``S{k}``."""
        k = _drafting_k(self, term)
        if k and predicted > 0 and measured > 0 and math.isfinite(measured):
            resid = measured * self.shape_correction(k) / predicted        # measured / (base x machine)
            key = f"S{k}"
            n = self.samples.get(key, 0)
            w = max(SHAPE_WEIGHT, 1.0 / (n + 1))
            old = self.scale.get(key, 1.0)
            new = math.exp((1 - w) * math.log(old) + w * math.log(min(SHAPE_DRIFT, max(1 / SHAPE_DRIFT, resid))))
            self.scale[key] = round(new, 5)
            self.samples[key] = n + 1
        super().observe(term, predicted, measured)

    def shape_correction(self, k: int) -> float:
        """V(k)'s correction from this pair's round records: their mean residual ``S{k}`` once it is
        off by more than its noise (``shape_noise``) over SHAPE_MIN_ROUNDS rounds, else 1. Reason: a
        profile timed on a busy machine (or a verify that costs other than calibration saw) keeps
        a wrong V(k)/t, which the shared machine factor cannot mend and the argmin follows."""
        s = self.scale.get(f"S{k}")
        if s is None or self.samples.get(f"S{k}", 0) < SHAPE_MIN_ROUNDS:
            return self._shorter_correction(k)
        return s if abs(math.log(s)) > math.log1p(self.shape_noise(k)) else 1.0

    def _shorter_correction(self, k: int) -> float:
        """A length with too few rounds of its own takes the correction of the longest shorter
        length that has one (1 if none). Reason: an argmin that a steep profile stopped at k = 4
        never runs the longer rounds that would correct them, and a busy calibration distorts
        neighbouring lengths alike; trying a longer k then measures it, and its own rounds decide."""
        for j in range(k - 1, 0, -1):
            key = f"S{j}"
            if key in self.scale and self.samples.get(key, 0) >= SHAPE_MIN_ROUNDS:
                s = self.scale[key]
                return s if abs(math.log(s)) > math.log1p(self.shape_noise(j)) else 1.0
        return 1.0

    def shape_noise(self, k: int) -> float:
        """V(k)'s noise: twice its calibration spread between repeats, at least SHAPE_NOISE."""
        spread = (self.quality or {}).get("spread", {}).get(f"V{k}", 0.0)
        return max(SHAPE_NOISE, 2 * float(spread or 0.0))

    def corrections(self) -> dict[str, float]:
        """The V(k) corrections in force (own or borrowed), {"V(k)": factor}: the explorer and
        ``--json`` show them."""
        out = {}
        if not any(key[:1] == "S" for key in self.scale):
            return out
        for k in sorted(int(x) for x in self.V):
            c = self.shape_correction(k) if _drafting_k(self, f"R{k}") else 1.0
            if c != 1.0:
                out[f"V({k})"] = round(c, 3)
        return out

    # --------------------------------------------------------------- the model's terms
    def T(self, n: float) -> float:
        return 0.0 if n <= 0 else interp(self.T_pf, n) * self.factor("T")

    def D(self, n: float) -> float:
        return 0.0 if n <= 0 or not self.D_pf else interp(self.D_pf, n) * self.factor("D")

    def step(self, ctx: float) -> float:
        return self._t_at(ctx) * self.factor("t")

    def _t_at(self, ctx: float) -> float:
        """interp(self.t, ctx), kept per context until t's points are replaced (a round asks for it
        several times, each time after a forward, when Python runs cold)."""
        key = (id(self.t), len(self.t))
        memo = getattr(self, "_t_memo", None)
        if memo is None or self._t_key != key or len(memo) > 4096:
            self._t_key, self._t_memo = key, {}
            memo = self._t_memo
        v = memo.get(ctx)
        if v is None:
            v = memo[ctx] = interp(self.t, ctx)
        return v

    def draft_step(self, ctx: float) -> float:
        """One draft forward (calibrated in the rounds loop: the machine factor only)."""
        return (interp(self.d, ctx) if self.d else 0.0) * self.factor("d")

    def draft_step2(self, ctx: float) -> float:
        """The draft's 2-token forward (it opens the round after one whose drafts were all accepted)."""
        return self.draft_step(ctx) * self.d2_ratio

    def draft_terms(self, ctx: float) -> tuple[float, float]:
        """(d, d2 - d) at ctx: a draft step and what its 2-token step costs beyond it."""
        d = self.draft_step(ctx)
        return d, max(0.0, self.draft_step2(ctx) - d)

    def round_terms(self, k: int, ctx: float) -> tuple[float, float, float]:
        """(d, d2 - d, V(k)) of a round of k at ctx, each with the round's own scale."""
        own = self.round_own(k)
        d, d2x = self.draft_terms(ctx)
        return d * own, d2x * own, self.verify(k, ctx)

    def draft_round(self, k: int, ctx: float, alpha: float) -> float:
        d, d2x, _ = self.round_terms(k, ctx)
        return round_draft_ms(k, alpha, d, d2x)

    def round_forwards(self, m: int, ctx: float, n_fwd: int, fed: int) -> float:
        """Predicted ms of one measured round: ``n_fwd`` draft forwards (the first reading ``fed``
        = 1 or 2 tokens) and the verify of m drafts."""
        d, d2x, v = self.round_terms(m, ctx)
        return n_fwd * d + (d2x if fed == 2 and n_fwd > 0 else 0.0) + v

    def verifies(self, k_max: int, ctx: float, over: float = 1.0) -> "Verifies":
        """[V(0) = t, V(1), ..., V(k_max)] at ctx: ``verify`` of each k (times ``over`` for k >= 1),
        each made when first read (the gate asks every round; most rounds read none or two)."""
        return Verifies(self, k_max, ctx, over)

    def verify(self, k: int, ctx: float) -> float:
        """V(k) at context ctx: measured at V_ctx, scaled with context like a step."""
        if k == 0:
            return self.step(ctx)
        return self._v_base(k) * self._v_ctx_scale(ctx) * self.factor(f"R{k}")

    def _v_base(self, k: int) -> float:
        """V(k) at V_ctx: measured, or interpolated between measured neighbours (V(0) = t)."""
        base = self.V.get(str(k))
        if base is None:
            key = (self.V_ctx, tuple(self.V.items()), id(self.t), len(self.t))
            if getattr(self, "_v_pts_key", None) != key:        # made again when V or t changed
                self._v_pts_key = key
                self._v_pts = [[0, self._t_at(self.V_ctx)]] + [[kk, self.V[str(kk)]]
                                                                   for kk in sorted(int(x) for x in self.V)]
            base = interp(self._v_pts, k)
        return base

    def _v_ctx_scale(self, ctx: float) -> float:
        """How a verify scales from V_ctx to ctx: like a step."""
        return self._t_at(ctx) / max(1e-9, self._t_at(self.V_ctx))

def _drafting_k(profile: "CostProfile", term: str) -> int:
    """k of a drafting round's term R{k} (one calibration timed in the rounds loop), else 0."""
    if term[:1] != "R" or not term[1:].isdigit() or profile.own_term(term):
        return 0
    return int(term[1:])


class Verifies:
    """The sequence [V(0) = t, V(1), ..., V(k_max)] of one profile at one context, each value made
    on first read and kept (the context's scale made once): a lookup that finds no match reads none."""

    __slots__ = ("_p", "_ctx", "_v", "_scale", "_over")

    def __init__(self, profile: "CostProfile", k_max: int, ctx: float, over: float = 1.0):
        self._p, self._ctx, self._over = profile, ctx, over
        self._v: list[float | None] = [None] * (max(0, int(k_max)) + 1)
        self._scale: float | None = None

    def __len__(self) -> int:
        return len(self._v)

    def __getitem__(self, j: int) -> float:
        v = self._v[j]
        if v is None:
            p = self._p
            if j == 0:
                v = p.step(self._ctx)
            else:
                if self._scale is None:
                    self._scale = p._v_ctx_scale(self._ctx)
                v = p._v_base(j) * self._scale * p.factor(f"R{j}") * self._over
            self._v[j] = v
        return v

    def __iter__(self):
        return (self[j] for j in range(len(self._v)))

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    __hash__ = None

    def __repr__(self) -> str:
        return f"Verifies({list(self)!r})"


# ----------------------------------------------------------------------------- fingerprints and files
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
    from ..backends import LeanBackend, backend_of
    from ..util.device import model_device
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


# ----------------------------------------------------------------------------- the vLLM proposer's profile
DEFAULT_V_SLOPE = 0.08       # no vLLM profile: V(k) = t (1 + DEFAULT_V_SLOPE k)


def load_vllm_profile(path: str | None) -> dict | None:
    """A vLLM cost profile (``rakv calibrate --engine vllm``: {"t_ms", "V_ms": {k: ms}, ...}), None
    without a path."""
    if not path:
        return None
    with open(path) as f:
        return json.load(f)


def verify_costs(profile: dict | None, k_max: int) -> list[float]:
    """[V(0) = t, V(1), ..., V(k_max)] in ms from a vLLM profile ({"t_ms", "V_ms": {k: ms}}):
    ``interp`` through (0, t) and the measured k (past the largest: its last slope); never below t."""
    if not profile:
        t = 1.0
        return [t * (1 + DEFAULT_V_SLOPE * k) for k in range(k_max + 1)]
    t = float(profile["t_ms"])
    pts = sorted([[0, t]] + [[int(k), float(v)] for k, v in profile.get("V_ms", {}).items() if int(k) > 0])
    return [max(t, interp(pts, k)) for k in range(k_max + 1)]


def profile_batches(profile: dict | None) -> dict[int, dict]:
    """The measured batch sizes of a vLLM profile: {B: {"t_ms", "V_ms", ...}}, batch 1 (the
    profile's ``batch``) from its top-level fields, every other B from ``by_batch`` (``rakv
    calibrate --engine vllm --batch-sizes``). A row's costs are per engine step: the ms of one step
    in which each of the B requests verifies k drafts (k = 0: a plain step), not per request."""
    if not profile:
        return {}
    if not isinstance(profile, dict) or "t_ms" not in profile:
        raise ValueError("a vLLM cost profile needs t_ms")
    out = {int(profile.get("batch", 1)): profile}
    by = profile.get("by_batch") or {}
    if not isinstance(by, dict):
        raise ValueError("by_batch must map batch sizes to {t_ms, V_ms}")
    for b, row in by.items():
        try:
            B = int(b)
        except (TypeError, ValueError):
            raise ValueError(f"by_batch: {b!r} is not a batch size") from None
        if B < 1 or not isinstance(row, dict) or "t_ms" not in row:
            raise ValueError(f"by_batch[{b!r}] must be a batch size >= 1 with t_ms and V_ms")
        out.setdefault(B, row)          # the top-level fields win for their own batch size
    return dict(sorted(out.items()))


def nearest_batch(sizes, batch: int) -> int:
    """The measured batch size nearest to ``batch`` on a log scale (a tie: the smaller one), so
    that B falls to the smaller of two measured sizes a < b exactly while B * B <= a * b."""
    sizes = sorted(int(b) for b in sizes)
    if not sizes:
        raise ValueError("no measured batch size")
    n = max(1, int(batch))
    return min(sizes, key=lambda b: (Fraction(max(n, b), min(n, b)), b))     # exact: no float ties


def verify_costs_for_batch(profile: dict | None, k_max: int, batch: int) -> list[float]:
    """``verify_costs`` at the measured batch size nearest to ``batch`` (``nearest_batch``): per
    engine step, [V(0) = t, V(1), ..., V(k_max)] in ms. A profile without ``by_batch`` gives its
    batch-1 costs for every batch size (as ``verify_costs``); no profile, the neutral default."""
    if not profile:
        return verify_costs(None, k_max)
    rows = profile_batches(profile)
    return verify_costs(rows[nearest_batch(rows, batch)], k_max)
