"""The cost model as maths: what each forward costs on this machine, refined by what it measures.

A ``CostProfile`` holds medians measured by calibration (``rakv.costs.calibration``) and is refined
online from every measured round:

  T_pf(n)   target prefill of n tokens        (piecewise-linear in n)
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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..config import LOOKUP_K
from ..device import clock

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
    # acceptance per sampling setting (rakv.sampling.Sampling.key, not "greedy"): {"alpha0": measured
    # prior, "alpha_learned": long-run rate, "alpha_trials": its evidence}; greedy uses the fields above
    alpha_by_setting: dict = field(default_factory=dict)
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

    # --------------------------------------------------------------- online refinement
    def observe(self, term: str, predicted: float, measured: float) -> None:
        """Refine the scales from one measurement of ``term`` (``predicted`` with the current
        scales): a term calibrated in the rounds loop moves the machine factor (all terms
        together); an own term (``own_term``) moves its own scale only. Robust: a clipped
        ratio, log-space EWMAs. When every term moved both, and a persistent offset
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
        if getattr(self, "_own_of", None) is not self.V or self._own_n != len(self.V):   # new or grown V
            ks = sorted(int(k) for k in self.V)
            self._own_of, self._own_n = self.V, len(self.V)
            self._own_ks = {f"R{k}" for k in ks if k not in drafting_ks(ks)}
        return term in self._own_ks

    def _weight(self, key: str) -> float:
        """This session's first measurements weigh 1/2, 1/3, ... (a stale profile is corrected within
        a few requests), later ones ONLINE_WEIGHT."""
        n = self._seen.get(key, 0)
        self._seen[key] = n + 1
        return 1.0 / (n + 2) if n < ONLINE_FIRST else ONLINE_WEIGHT


# ----------------------------------------------------------------------------- validation


# ----------------------------------------------------------------------------- calibration


def lookup_vs(k_max: int) -> list[int]:
    """Verify lengths measured past k_max (no draft): a gated n-gram lookup may verify up to
    config.LOOKUP_K tokens, and V past the measured ones must not be a guess (V is not linear)."""
    return [k for k in sorted({(k_max + LOOKUP_K) // 2, LOOKUP_K}) if k > k_max]




def round_draft_ms(k: int, alpha: float, d: float, d2x: float) -> float:
    """Expected draft ms of a k-token round: k steps of d, the first one d2x dearer when the round
    before accepted all its k drafts (chance alpha^k at i.i.d. acceptance alpha)."""
    return 0.0 if k <= 0 else k * d + min(1.0, max(0.0, alpha)) ** k * d2x


def drafting_ks(ks: list[int]) -> list[int]:
    """The k a drafting policy may use: the measured ones up to k_max, without the lengths past
    it that calibration adds for n-gram lookups only (``costs.lookup_vs``)."""
    for m in ks:
        if [k for k in ks if k > m] == lookup_vs(m) and lookup_vs(m):
            return [k for k in ks if k <= m]
    return ks


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
