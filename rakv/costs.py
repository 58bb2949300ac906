"""Measured cost model: what each forward costs on *this* machine, for *this* model pair.

A profile holds medians measured by a calibration pass (``rakv calibrate``; automatically the
first time a pair is used) and is refined online from every measured round:

  T_pf(n)   target prefill of n tokens        (piecewise-linear in n)
  D_pf(n)   draft prefill / catch-up of n tokens
  t(c)      target one-token step at context c (piecewise-linear in c)
  d(c)      draft one-token step at context c
  V(k)      target verify forward over k+1 tokens, per k (no formula: not monotone on CPU),
            scaled with context like t(c)
  clone     prefix-cache clone/store cost per token; lookup cost
  alpha0    acceptance measured during calibration (the controller's prior)

Online refinement: every prediction is base x machine (x own, for some terms). ``machine``
(scale["machine"]) is one factor moved by every measurement of a term calibration timed in its
interleaved rounds loop (t and the rounds R{k} up to k_max): when the machine slows down (another
process, a frequency change) all terms move together, and the ratios that decide k (V(k)/t, d/t,
measured interleaved at calibration) stay as calibrated. They were right to 0.6% (session 12);
own scales learned from noisy rounds only moved them (session 5: a step measured during a burst
of load made k = 1 look 30% cheaper than k = 0; session 13: in replay, calibration's ratios alone
chose k at 0.998 of the best fixed policy on average over 10 int8 runs, the learned ones at
1.016). A speculative round of k is one term, ``R{k}``: its draft forwards and its verify are
measured together.
The terms calibration did not time as the engine pays them learn an own scale relative to the
machine factor (``CostProfile.own_term``) and never move it: the prefills (a prefill after a
cached prefix runs dearer than calibration's from scratch: the draft's 1.2-1.5x) and verify
lengths past k_max, an n-gram lookup's (V(16): 2.2 t live against 1.84 t calibrated).

Profiles are JSON files in the cache dir, keyed by a machine fingerprint (CPU model, threads,
torch version, device (and GPU name), fast path on/off), the model pair and dtype. A changed
fingerprint means a new calibration. ``regime`` holds the per-machine regime figures that
``rakv calibrate`` prints: the step against the measured weight-streaming floor, V(k)/t, d/t, the
CPU's ISA flags and threads.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import MISSING as dataclass_missing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

import torch

from . import decoding as dec
from .config import LOOKUP_K
from .meter import SHARE_QUIET, Meter, Timing, check_enabled, cpu_clock, is_quiet, time_reps
from .device import clock
from .records import hardware_info
from .regime import round_draft_ms

now = clock          # synchronizes CUDA / MPS before reading the time
PROFILE_VERSION = 12         # 12: V(k) floored at the step it contains
                             # 11: rounds R{k} as one term; own scales only for prefills and lookup lengths
                             # 10: the draft's two-token step (d2_ratio)
                             # 9: the lean forward (its steps; the int8 draft's fused layers); D refined online
                             # 8: V measured past k_max (lookup_vs) for n-gram lookups
                             # 7: the quality section (spread per term, CPU share, contended)
ONLINE_WEIGHT = 0.1          # weight of one new measurement in the online (log-space) EWMA
ONLINE_FIRST = 4             # this session's first measurements of a term weigh 1/2, 1/3, 1/4, 1/5 (a stale
                             # profile is corrected within a few requests), later ones ONLINE_WEIGHT
ONLINE_CLIP = 2.0            # a single measurement may move a scale by at most this factor
MACHINE = "machine"          # the shared factor's key in ``scale``
PREFILL_TERMS = ("T", "D")   # with the lookup lengths past k_max: the terms with an own scale (own_term)
OWN_DRIFT = 2.0              # an own scale's bound


def _bounded(own: float, drift: float = OWN_DRIFT) -> float:
    """An own online scale, kept within ``drift`` of 1."""
    return min(drift, max(1.0 / drift, own))


def fingerprint(target_key: str, draft_key: str, dtype: str, device: str = "cpu", fast: bool = False) -> dict:
    hw = hardware_info()
    fp = {"cpu": hw["cpu"], "threads": torch.get_num_threads(), "torch": torch.__version__,
          "target": target_key, "draft": draft_key, "dtype": dtype, "version": PROFILE_VERSION,
          "device": device, "fast": bool(fast)}
    if device.startswith("cuda") and torch.cuda.is_available():
        fp["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return fp


def pair_fingerprint(target, draft) -> dict:
    """The fingerprint of this machine and pair as loaded (device and fast path read off the model)."""
    from .device import model_device
    from .fastpath import is_enabled, one_row_kernel

    fp = fingerprint(target.key, getattr(draft, "key", "none"), str(next(target.model.parameters()).dtype),
                     device=str(model_device(target.model)), fast=is_enabled(target.model))
    if one_row_kernel(target.model) == "packed":     # a step on the other kernel is another machine
        fp["one_row"] = "packed"
    if getattr(target.model, "_rakv_lean", None) is not None:    # so is a step on the lean forward
        fp["lean"] = True
    if target.blockq.get("layers"):                               # and one from exact block codes
        fp["blockq"] = int(target.blockq["layers"])
    return fp


def fingerprint_id(fp: dict) -> str:
    return hashlib.blake2b(json.dumps(fp, sort_keys=True).encode(), digest_size=8).hexdigest()


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
class CostProfile:
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
    # the draft's confidence against acceptance, per bin (rakv.gate): {"hits": [...], "n": [...]}
    accept_map: dict = field(default_factory=dict)
    calibrated_at: str = ""
    calibration_s: float = 0.0
    # online refinement: multiplicative scales (log-space EWMA of measured / predicted)
    scale: dict[str, float] = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=dict)
    # how clean the calibration was (rakv/meter.py): spread per term, CPU share, retries,
    # curves made monotone, and contended (measured while the machine was busy)
    quality: dict = field(default_factory=dict)

    @property
    def contended(self) -> bool:
        return bool(self.quality.get("contended"))

    def __post_init__(self):
        self._seen: dict[str, int] = {}      # measurements per term in this session (not saved)
    # regime figures of this machine (measured at calibration; see regime_figures)
    regime: dict = field(default_factory=dict)

    # --------------------------------------------------------------- the model's terms
    def factor(self, term: str) -> float:
        """The online scale of a term: the shared machine factor, times its own for an own term."""
        m = self.scale.get(MACHINE, 1.0)
        return m * _bounded(self.scale.get(term, 1.0)) if self.own_term(term) else m

    def T(self, n: float) -> float:
        return 0.0 if n <= 0 else interp(self.T_pf, n) * self.factor("T")

    def D(self, n: float) -> float:
        return 0.0 if n <= 0 or not self.D_pf else interp(self.D_pf, n) * self.factor("D")

    def step(self, ctx: float) -> float:
        return interp(self.t, ctx) * self.factor("t")

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

    def round_own(self, k: int) -> float:
        """The own online scale of a speculative round of k (its drafts and verify together)."""
        return _bounded(self.scale.get(f"R{k}", 1.0)) if k > 0 and self.own_term(f"R{k}") else 1.0

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

    def verify(self, k: int, ctx: float) -> float:
        """V(k) at context ctx: measured at V_ctx, scaled with context like a step."""
        if k == 0:
            return self.step(ctx)
        base = self.V.get(str(k))
        if base is None:   # unmeasured k: interpolate between measured neighbours
            ks = sorted(int(x) for x in self.V)
            pts = [[kk, self.V[str(kk)]] for kk in ks]
            pts.insert(0, [0, interp(self.t, self.V_ctx)])
            base = interp(pts, k)
        ctx_factor = interp(self.t, ctx) / max(1e-9, interp(self.t, self.V_ctx))
        return base * ctx_factor * self.factor(f"R{k}")

    # --------------------------------------------------------------- online refinement
    def observe(self, term: str, predicted: float, measured: float) -> None:
        """Refine the scales from one measurement of ``term`` (``predicted`` with the current
        scales): a term calibrated in the rounds loop moves the machine factor (all terms
        together); an own term (``own_term``) moves its own scale only. Robust: a clipped
        ratio, log-space EWMAs. Before session 13 every term moved both, and a persistent offset
        of one (D at 1.3x) pushed the machine factor from 1.07 to 1.25 over 36 requests and the
        others' own scales to their bounds (s13b)."""
        if predicted <= 0 or measured <= 0 or not math.isfinite(measured):
            return
        r = min(ONLINE_CLIP, max(1.0 / ONLINE_CLIP, measured / predicted))
        if self.own_term(term):
            self.scale[term] = _bounded(_bounded(self.scale.get(term, 1.0)) * r ** self._weight(term))
        else:
            self.scale[MACHINE] = self.scale.get(MACHINE, 1.0) * r ** self._weight(MACHINE)
        self.samples[term] = self.samples.get(term, 0) + 1

    def own_term(self, term: str) -> bool:
        """A term calibration did not time as the engine pays it: a prefill, or a verify length
        past the drafting k_max (``lookup_vs``: an n-gram lookup's, timed without a draft)."""
        if term in PREFILL_TERMS:
            return True
        if not term.startswith("R") or not term[1:].isdigit():
            return False
        key = tuple(self.V)
        if getattr(self, "_own_key", None) != key:
            from .regime import drafting_ks

            ks = sorted(int(k) for k in self.V)
            self._own_key, self._own_ks = key, {f"R{k}" for k in ks if k not in drafting_ks(ks)}
        return term in self._own_ks

    def _weight(self, key: str) -> float:
        """This session's first measurements weigh 1/2, 1/3, ... (a stale profile is corrected within
        a few requests), later ones ONLINE_WEIGHT."""
        n = self._seen.get(key, 0)
        self._seen[key] = n + 1
        return 1.0 / (n + 2) if n < ONLINE_FIRST else ONLINE_WEIGHT

    # --------------------------------------------------------------- persistence
    def save(self, path: Path) -> None:
        """Atomic: a unique temp file in the same dir, then os.replace (concurrent saves never collide)."""
        write_atomic(Path(path), json.dumps(asdict(self), indent=1))

    @staticmethod
    def load(path: Path) -> "CostProfile | None":
        """The profile at ``path``; None if there is none; ProfileError if it is malformed."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as e:
            raise ProfileError(f"cannot read cost profile {path}: {e}") from None
        try:
            d = json.loads(text)
        except ValueError as e:
            raise ProfileError(f"cost profile {path} is not valid JSON ({e})") from None
        problem = profile_problem(d)
        if problem:
            raise ProfileError(f"cost profile {path} is malformed: {problem}")
        return CostProfile(**d)


class ProfileError(ValueError):
    """A saved cost profile is unreadable or malformed; the message names the file."""


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# ----------------------------------------------------------------------------- validation
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
}


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
        profile.save(profile_path(cache, profile.fingerprint))
    except OSError as e:
        return str(e)
    return None


def profile_path(cache: Path, fp: dict) -> Path:
    return cache / "profiles" / f"{fingerprint_id(fp)}.json"


# ----------------------------------------------------------------------------- calibration
CAL_TEXT = (
    "The history of the city begins with a small settlement on the river. Over the centuries it "
    "grew into a centre of trade, with markets, bridges and a cathedral. In the nineteenth century "
    "the railway arrived, and factories were built along the banks. Today the city is known for its "
    "university, its museums and its parks, and for the festival held every summer. "
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i))\n"
)


def _median_ms(fn: Callable[[], None], reps: int) -> float:
    return time_reps(fn, reps).value


def calibration_ids(tokenizer, n: int, vocab: int) -> list[int]:
    if tokenizer is not None:
        ids = tokenizer(CAL_TEXT, add_special_tokens=False)["input_ids"]
    else:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (256,), generator=g).tolist()
    out = []
    while len(out) < n:
        out.extend(ids)
    return out[:n]


def calibrate(target, draft, k_max: int = 8, progress: Callable[[float, str], None] | None = None,
              quick: bool = False, meter: Meter | None = None) -> CostProfile:
    """Measure every term of the cost model on this machine. ``draft`` is a DraftSource.

    Every term goes through a Meter (rakv/meter.py): noisy terms are measured again, prefill and
    step curves must rise with length, and the profile's ``quality`` says how clean it all was
    (``contended`` when the machine was busy)."""
    from .drafts import ModelDraft

    t_start = now()
    meter = meter or Meter()
    maxpos = target.max_positions or 2048
    reps = 2 if quick else 3
    pf_ns = [n for n in ([8, 32, 128] if quick else [8, 32, 128, 384]) if n < maxpos // 2]
    ctxs = [c for c in ([16, 128] if quick else [16, 128, 512]) if c + 16 < maxpos]
    ids = calibration_ids(target.tokenizer, max(pf_ns + ctxs) + k_max + 32, target.vocab_size)
    dmodel = draft.lm.model if isinstance(draft, ModelDraft) else None
    steps = len(pf_ns) * (2 if dmodel is not None else 1) + len(ctxs) * (2 if dmodel is not None else 1) + 1 + 2
    done = 0

    def tick(what: str):
        nonlocal done
        done += 1
        if progress:
            progress(min(1.0, done / steps), what)

    def pf_cost(model, n, name):
        def run():
            dec.prefill(model, ids[:n], dec.DynamicCache())

        def timing():
            run()   # warm-up, excluded
            return time_reps(run, reps)
        return meter.measure(f"{name}@{n}", timing).value

    def step_cost(model, ctx, name, n_steps=5 if quick else 10):
        def timing():
            cache = dec.DynamicCache()
            dec.prefill(model, ids[:ctx], cache)
            it = iter(range(ctx, ctx + n_steps))
            for _ in range(2):                                 # the first steps run cold: excluded
                dec.decode_one(model, ids[next(it)], cache)
            return time_reps(lambda: dec.decode_one(model, ids[next(it)], cache), n_steps - 2)
        return meter.measure(f"{name}@{ctx}", timing).value

    def curve(model, xs, name, cost):
        pts = []
        for x in xs:
            pts.append([x, cost(model, x, name)])
            tick(f"{'target' if model is target.model else 'draft'} {name} {x}")
        return meter.monotone(name, pts, lambda i: cost(model, pts[i][0], name))

    prof = CostProfile()
    model = target.model
    dec.prefill(model, ids[:16], dec.DynamicCache())   # global warm-up
    prof.T_pf = curve(model, pf_ns, "T_pf", pf_cost)
    prof.t = curve(model, ctxs, "t", step_cost)
    V_ctx = min(128, max(ctxs))
    prof.V_ctx = V_ctx
    if dmodel is not None:
        dec.prefill(dmodel, ids[:16], dec.DynamicCache())
        prof.D_pf = curve(dmodel, pf_ns, "D_pf", pf_cost)
        prof.d = curve(dmodel, ctxs, "d", step_cost)
    # Verify costs and the draft step as *ratios to a target step*, measured interleaved in one
    # loop (rotated order) so that machine drift or a neighbour's load hits them all alike.
    ratios = interleaved_ratios(model, dmodel, ids, V_ctx, k_max, reps=4 if quick else 7, tick=tick, meter=meter,
                                extra=lookup_vs(k_max))
    t_ref = interp(prof.t, V_ctx)
    # a verify of k+1 tokens does a step's work and more: a ratio below 1 is noise (layers:6 V(1)/t
    # 0.88, s13m), and calibration's ratios are what the controller keeps
    prof.V.update({str(k): max(1.0, r) * t_ref for k, r in ratios.items() if k not in ("d", "d2")})
    if dmodel is not None:
        d_ref = interp(prof.d, V_ctx)
        prof.d = [[c, ms * ratios["d"] * t_ref / d_ref] for c, ms in prof.d]
        prof.d2_ratio = round(min(8.0, max(1.0, ratios["d2"] / ratios["d"])), 4) if ratios.get("d") else 1.0
    else:
        prof.d = [[16, 0.02], [1024, 0.05]] if draft.name == "ngram" else []
    # clone/store cost per token (KV copy) and lookup cost
    cache = dec.DynamicCache()
    dec.prefill(model, ids[:128], cache)
    prof.clone_ms_per_token = _median_ms(lambda: dec.kv_of(cache, 128), 5) / 128
    from .gate import AcceptMap

    amap = AcceptMap()
    prof.alpha0 = measure_alpha(target, draft, ids, k=4, rounds=4 if quick else 8, amap=amap)
    prof.accept_map = amap.counts()
    tick("acceptance")
    prof.quality = meter.quality()
    prof.regime = regime_figures(target, prof, reps=3 if quick else 5)
    prof.calibration_s = now() - t_start
    prof.calibrated_at = time.strftime("%Y-%m-%dT%H:%M:%S")
    return prof


def regime_figures(target, prof: CostProfile, reps: int = 5) -> dict:
    """Where this machine's step sits: against the weight-streaming floor, V(k)/t, d/t, ISA, threads.

    The floor is measured, not computed from a bandwidth figure: one pass over all of the target's
    linear layers on 1 row (``fastpath.linear_floor_ms``; the weights stream from memory as in a
    step), with whatever kernel the forward uses (packed oneDNN on the fast path).
    """
    from .device import isa_flags, model_device, threads_info
    from .fastpath import is_enabled, linear_floor_ms, one_row_kernel

    model = target.model
    ctx = prof.V_ctx
    t = interp(prof.t, ctx)
    floor = linear_floor_ms(model, rows=1, reps=reps)
    floor_v4 = linear_floor_ms(model, rows=5, reps=reps)
    d = interp(prof.d, ctx) if prof.d else 0.0
    return {
        "device": str(model_device(model)), "fast": is_enabled(model), "one_row_kernel": one_row_kernel(model),
        "lean": getattr(model, "_rakv_lean", None) is not None,
        "block_layers": target.blockq.get("layers", 0),
        **threads_info(), "isa": isa_flags(),
        "ctx": ctx, "step_ms": round(t, 3),
        "floor_ms": round(floor, 3), "floor_method": "one pass over all linear layers, 1 row (measured)",
        "step_over_floor": round(t / floor, 3) if floor > 0 else None,
        "floor5_ms": round(floor_v4, 3),
        "V_over_t": {k: round(prof.V[k] / t, 3) for k in sorted(prof.V, key=int)} if t > 0 else {},
        "d_over_t": round(d / t, 3) if t > 0 and d > 0 else None,
        "d2_over_d": round(prof.d2_ratio, 3) if d > 0 else None,
    }


def lookup_vs(k_max: int) -> list[int]:
    """Verify lengths measured past k_max (no draft): a gated n-gram lookup may verify up to
    config.LOOKUP_K tokens, and V past the measured ones must not be a guess (V is not linear)."""
    return [k for k in sorted({(k_max + LOOKUP_K) // 2, LOOKUP_K}) if k > k_max]


def interleaved_ratios(model, dmodel, ids, ctx: int, k_max: int, reps: int, tick=None,
                       meter: Meter | None = None, extra: list[int] = ()) -> dict:
    """Costs as the engine pays them, as ratios to a 1-token target forward at context ``ctx``.

    One "round" of key k (1..k_max) is what a speculative round does: k consecutive 1-token
    draft forwards, then a (k+1)-token target verify (both rolled back after). Key 0 is a plain
    target step. All keys run interleaved in a rotated order, so drift or a neighbour's load hits
    them alike. Measured in the loop, not in isolation: a lone draft forward after a target
    forward runs cold and costs ~40% more than the steps of a real drafting run.
    Keys in ``extra`` (past k_max) time the verify alone: n-gram lookups, which draft nothing.
    Returns {k: V(k)/t} and (with a draft model) "d": median draft ms per drafted token / t, and
    "d2": the draft's 2-token forward / t.
    The whole block is measured again (``meter``) when its timings are noisy.
    """
    meter = meter or Meter(check=False)
    out = meter.measure_many("V", lambda: _interleaved_block(model, dmodel, ids, ctx, k_max, reps, extra))
    if tick:
        tick("verify/step ratios")
    return out


def _interleaved_block(model, dmodel, ids, ctx: int, k_max: int, reps: int, extra=()) -> tuple[dict, dict]:
    base = dec.DynamicCache()
    dec.prefill(model, ids[:ctx], base)
    dbase = None
    if dmodel is not None:
        dbase = dec.DynamicCache()
        dec.prefill(dmodel, ids[:ctx], dbase)
    keys = list(range(0, k_max + 1)) + [k for k in extra if k > k_max]
    xs: dict = {key: Timing() for key in keys}
    ds, d2 = Timing(), Timing()

    def once(k):
        if k == 0:
            t0, c0 = now(), cpu_clock()
            dec.decode_one(model, ids[ctx], base)
            ms = (now() - t0, cpu_clock() - c0)
            dec.rollback(base, 1)
            return ms, None
        d_ms = None
        if dbase is not None and k <= k_max:
            if k == 1:      # the 2-token step that opens a round after a fully accepted one (after a verify, as there)
                t0, c0 = now(), cpu_clock()
                dec.prefill(dmodel, ids[ctx: ctx + 2], dbase)
                d2.add(now() - t0, cpu_clock() - c0)
                dec.rollback(dbase, 2)
            t0, c0 = now(), cpu_clock()
            for i in range(k):      # q_i = draft(x_{<ctx+i})
                dec.decode_one(dmodel, ids[ctx + i], dbase)
            d_ms = ((now() - t0) / k, (cpu_clock() - c0) / k)
            dec.rollback(dbase, k)
        toks = ids[ctx: ctx + k + 1]
        t0, c0 = now(), cpu_clock()
        dec.verify(model, toks, base)
        ms = (now() - t0, cpu_clock() - c0)
        dec.rollback(base, k + 1)
        return ms, d_ms

    for key in keys:       # warm-up, excluded
        once(key)
    for r in range(reps):
        order = keys[r % len(keys):] + keys[: r % len(keys)]
        for key in order:
            ms, d_ms = once(key)
            xs[key].add(*ms)
            if d_ms is not None:
                ds.add(*d_ms)
    t1 = xs[0].value
    out = {key: v.value / t1 for key, v in xs.items() if key != 0}
    timings = {("t@ratio" if key == 0 else f"V{key}"): v for key, v in xs.items()}
    if ds.ms:
        out["d"] = ds.value / t1
        timings["d@ratio"] = ds
    if d2.ms:
        out["d2"] = d2.value / t1
        timings["d2@ratio"] = d2
    return out, timings


# prompts for a model draft's acceptance prior: plain prose, history prose and code (the kinds of
# text the workloads hold). The target continues each freely; one text alone gave 0.67 where the
# WikiText-2, HumanEval and repetitive workloads measure 0.78-0.88, and each run starts from it.
ALPHA_TEXTS = (
    CAL_TEXT.split(" def ")[0],
    "The river flows through the valley past old mills and farms. In spring the water rises and "
    "the meadows flood, and birds return to nest along the banks. Farmers in the region grow "
    "wheat, barley and apples, and",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"
    "    a, b = 0, 1\n    for _ in range(n - 1):\n        a, b = b, a + b\n    return b\n\n\n"
    "def is_prime(n):\n",
)


def measure_alpha(target, draft, ids, k: int = 4, rounds: int = 8, amap=None) -> float:
    """Per-token acceptance of the draft over a few greedy rounds, pooled over the prompts; with
    ``amap`` (rakv.gate.AcceptMap) each drafted token's confidence and outcome go into it too."""
    from .drafts import ModelDraft, NoDraft

    if isinstance(draft, NoDraft):
        return 0.0
    tok = target.tokenizer
    if isinstance(draft, ModelDraft):
        # a model draft costs real time per drafted token: measure on text that does not repeat
        prompts = ([tok(t, add_special_tokens=False)["input_ids"][:64] for t in ALPHA_TEXTS]
                   if tok is not None else [ids[:64]])
    else:
        # n-gram lookup (free to draft): the calibration text cycles and this prompt ends where it
        # starts to repeat, a deliberately optimistic prior (drafting rounds then correct it; a
        # pessimistic one would only be corrected by probes)
        period = len(tok(CAL_TEXT, add_special_tokens=False)["input_ids"]) if tok is not None else 256
        prompts = [ids[: max(16, min(period + 16, len(ids) - rounds * (k + 1) - 2))]]
    acc = trials = 0
    for prompt in prompts:
        a, n = _accept_rounds(target, draft, prompt, k, rounds, amap)
        acc, trials = acc + a, trials + n
    return acc / trials if trials else 0.0


def _accept_rounds(target, draft, prompt, k: int, rounds: int, amap=None) -> tuple[int, int]:
    """(accepted, trials) over ``rounds`` greedy rounds of k drafts after ``prompt``."""
    from .controller import trials as round_trials
    from .gate import recording_gate

    draft.begin(prompt, None, False)
    cache = dec.DynamicCache()
    logits = dec.prefill(target.model, prompt, cache)
    seq = list(prompt) + [dec.argmax(logits)]
    acc = trials = 0
    for _ in range(rounds):
        gate = recording_gate(amap, k) if amap is not None else None
        prop = draft.propose(seq, k, gate).tokens
        if not prop:
            logits = dec.decode_one(target.model, seq[-1], cache)
            seq.append(dec.argmax(logits))
            trials += 1
            continue
        logits = dec.verify(target.model, [seq[-1]] + prop, cache)
        pred = torch.argmax(logits, dim=-1).tolist()
        a = dec.accept(prop, pred)
        if gate is not None:
            amap.observe(gate.confs, gate.preds, a)
        dec.rollback(cache, len(prop) - a)
        seq += prop[:a] + [pred[a]]
        draft.commit(seq)
        acc += a
        trials += round_trials(a, len(prop))
    draft.end()
    return acc, trials


def load_or_calibrate(target, draft, cache: Path, k_max: int = 8, force: bool = False,
                      quick: bool = False, progress=None, log=None) -> tuple[CostProfile, bool]:
    """The profile for this machine + pair, calibrating if missing or the fingerprint changed.

    A malformed profile is reported (naming the file) and measured again. Calibration runs under a
    lock per profile: a second process for the same pair waits and then loads what the first saved
    (two calibrations at once would also measure each other's load)."""
    from .filelock import file_lock

    say = log or (lambda m: print(f"[rakv] {m}", file=sys.stderr, flush=True))
    fp = pair_fingerprint(target, draft)
    path = profile_path(cache, fp)
    if not force:
        prof = _usable(path, fp, k_max, say)
        if prof is not None and not _stale_contended(prof, target, say):
            return prof, False
    with file_lock(path.with_suffix(".lock"),
                   on_wait=lambda: say("another process is calibrating this pair; waiting for its profile ...")):
        if not force:
            again = _usable(path, fp, k_max, lambda m: None)    # saved meanwhile by that process?
            if again is not None and (prof is None or again.calibrated_at != prof.calibrated_at):
                return again, False
        say(f"calibrating costs for this machine and pair (one time; profile {path.name}) ...")
        meter = Meter()
        busy = busy_now(target)
        if busy:
            say(f"the machine is busy ({busy}): a quick calibration, saved marked contended and measured "
                "again on a later run when the machine is quiet")
            meter.note(f"busy when calibration started: {busy}")
        prof = calibrate(target, draft, k_max=k_max, progress=progress, quick=quick or bool(busy), meter=meter)
        prof.fingerprint = fp
        if prof.contended:
            say("calibration ran on a busy machine (" + "; ".join(prof.quality.get("reasons", [])) + "): the "
                "profile is saved marked contended, and a later run on a quiet machine measures again")
        try:
            prof.save(path)
        except OSError as e:     # a read-only cache dir: run on the profile in memory
            say(f"cannot save the cost profile to {path} ({e.strerror or e}); using it for this run only")
            prof.read_only = True     # and no save of what this run learns either (warned once)
    return prof, True


def _stale_contended(prof: CostProfile, target, say) -> bool:
    """A profile measured under contention: measure again if the machine is quiet now."""
    if not prof.contended or not check_enabled():
        return False
    probe = quiet_probe(target)
    if is_quiet(probe):
        say("the saved cost profile was measured on a busy machine and this one is quiet now: measuring again")
        return True
    say(f"the saved cost profile was measured on a busy machine (still busy: CPU share {probe.share:.0%}); "
        "using it, refined as requests run")
    return False


def busy_now(target) -> str | None:
    """Why the machine looks busy right now (a short probe of target steps), or None if quiet.
    A busy machine gets a quick calibration: full repeats would only measure the load, slowly."""
    if not check_enabled():
        return None
    # Another process shows as a low CPU share. A high spread alone is not enough: this VM's host
    # gives quiet probes 38% spread at a 100% share (docs/results.md, session 6).
    for _ in range(2):          # twice: one bad probe on a quiet machine is not enough to say busy
        probe = quiet_probe(target)
        if probe.share >= SHARE_QUIET:
            return None
    return f"CPU share {probe.share:.0%}, spread {probe.spread:.0%}"


def quiet_probe(target, n: int = 8) -> Timing:
    """A short timing of target steps (~n forwards at a short context) to tell a quiet machine."""
    ids = calibration_ids(target.tokenizer, 16 + n + 1, target.vocab_size)
    cache = dec.DynamicCache()
    dec.prefill(target.model, ids[:16], cache)
    it = iter(range(16, 16 + n + 1))
    dec.decode_one(target.model, ids[next(it)], cache)
    return time_reps(lambda: dec.decode_one(target.model, ids[next(it)], cache), n)


def _usable(path: Path, fp: dict, k_max: int, say) -> CostProfile | None:
    try:
        prof = CostProfile.load(path)
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
        prof = CostProfile.load(path)
    except ProfileError as e:
        print(f"[rakv] {e}", file=sys.stderr)
        prof = None
    return prof, path


def check_profile(prof: CostProfile, target, draft, reps: int = 5) -> tuple[list[dict], float]:
    """A few quick terms measured now (target step, V(4), prefill of 32, the draft's step) against
    what the profile predicts (with its learned scales); also the CPU share seen now."""
    from .drafts import ModelDraft

    ctx = prof.V_ctx
    ids = calibration_ids(target.tokenizer, ctx + 48, target.vocab_size)
    model, meter = target.model, Meter(check=False)
    dmodel = draft.lm.model if isinstance(draft, ModelDraft) else None
    dec.prefill(model, ids[:16], dec.DynamicCache())      # warm-up
    rows = []

    def row(term, predicted, timing):
        t = meter.measure(term, timing)
        rows.append({"term": term, "profile_ms": round(predicted, 3), "now_ms": round(t.value, 3),
                     "ratio": round(t.value / predicted, 3) if predicted > 0 else float("nan"),
                     "spread": round(t.spread, 3)})

    def pf():
        return time_reps(lambda: dec.prefill(model, ids[:32], dec.DynamicCache()), reps)

    def at_ctx(m, n_tok):
        cache = dec.DynamicCache()
        dec.prefill(m, ids[:ctx], cache)
        fwd = dec.decode_one if n_tok == 1 else (lambda mm, _t, c: dec.verify(mm, ids[ctx: ctx + n_tok], c))

        def once():
            fwd(m, ids[ctx], cache)
            dec.rollback(cache, n_tok)
        once()
        return time_reps(once, reps)

    row("step@%d" % ctx, prof.step(ctx), lambda: at_ctx(model, 1))
    row("V(4)@%d" % ctx, prof.verify(4, ctx), lambda: at_ctx(model, 5))
    row("prefill 32", prof.T(32), pf)
    if dmodel is not None and prof.d:
        row("draft step@%d" % ctx, prof.draft_step(ctx), lambda: at_ctx(dmodel, 1))
    return rows, meter.quality()["cpu_share"]


def text_progress(prefix: str = "calibrate"):
    """A one-line progress bar on stderr."""
    def show(frac: float, what: str):
        w = 30
        n = int(frac * w)
        sys.stderr.write(f"\r[rakv] {prefix} [{'#' * n}{'.' * (w - n)}] {frac * 100:5.1f}% {what:<24}")
        if frac >= 1.0:
            sys.stderr.write("\n")
        sys.stderr.flush()
    return show
