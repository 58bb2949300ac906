"""The decision's mutable learned state: what served requests and measured rounds teach.

``AlphaEWMA`` (per round) and ``Acceptance``, the controller's request-level estimates: the long
run, the recent requests and the measured persistence of their deviations (``alpha_req``), the
acceptance by draft position (``shape``), the evidence behind alpha's optimistic bound, the output
share, and all of it kept per sampling setting and written back into the cost profile
(``alpha_learned``, ``alpha_trials``, ``alpha_by_setting``, ``out_frac``) for the next session.
``OnlineScales``: the cost profile's online refinement (the machine factor and the own scales of
the terms calibration did not time as the engine pays them); the measured terms themselves are
``rakv.decide.profile``'s. The constants' evidence is in docs/controller.md#constants.
"""

from __future__ import annotations

import copy
import math

from ..util.acceptance import trials
from .policy import drafting_ks, shape_signal

PRIOR_TRIALS = 8.0   # weight of the long-run acceptance in the request-level one, in trials
LONG_WINDOW = 200.0  # the long-run acceptance averages about the last this many trials
LONG_PRIOR = 32.0    # ... starting from this many pseudo-trials at the prior (a probe barely moves it)
LONG_DECAY = 0.05    # per-request ageing of the evidence count behind alpha's optimistic bound
OUT_DECAY = 0.1      # per-request weight of the output-share EWMA
OUT_FRAC_START = 1.0  # ... which every engine starts here: requests run to max_new_tokens
UCB_Z = 2.0          # alpha's optimistic bound: estimate + UCB_Z standard errors
MAX_EVIDENCE = 400   # trials counted for that bound at most (and it ages by LONG_DECAY a request)
PERSIST_PRIOR = 4.0   # the persistence of request acceptance starts as this many requests at w = 1
PERSIST_SD = 0.05     # ... each with this deviation from the long run (its weight against evidence)
PERSIST_DECAY = 0.05  # per-request ageing of the persistence evidence (~20 requests)
PERSIST_MIN_TRIALS = 4  # a request counts toward persistence with at least this many trials
AHEAD_PRIOR = 40.0    # the rounds-ahead acceptance: a request's own trials plus this many at the request-level rate
SHAPE_PRIOR = 16.0    # pseudo-trials per draft position at the pooled rate (the i.i.d. model) before any round
SHAPE_DECAY = 0.005   # per-round ageing of the position counts (about the last 200 rounds)
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


class AlphaEWMA:
    def __init__(self, prior: float = 0.5, lam: float = 0.3):
        self.lam = lam
        self.S = prior          # EWMA of accepted tokens per round (weighted as one pseudo-trial)
        self.T = 1.0            # EWMA of trials per round
        self.rounds = 0

    @property
    def value(self) -> float:
        return self.S / self.T if self.T > 0 else 0.0

    def update(self, accepted: int, drafted: int) -> float:
        if drafted <= 0:
            return self.value
        lam = self.lam
        self.S = (1 - lam) * self.S + lam * accepted
        self.T = (1 - lam) * self.T + lam * trials(accepted, drafted)
        self.rounds += 1
        return self.value


class Acceptance:
    """The controller's learned acceptance and output share (a base of ``Controller``; ``profile``
    is the cost profile the learned rates are written into)."""

    profile: object

    def _init_learned(self, profile, alpha_prior: float | None, lam: float, req_decay: float,
                      out_decay: float, k_top: int) -> None:
        self.profile = profile
        if alpha_prior is None:
            alpha_prior = profile.alpha_learned if profile.alpha_learned is not None else profile.alpha0
        self.alpha = AlphaEWMA(alpha_prior, lam)
        self._rS = self._rT = 0.0                            # recent requests (weight req_decay)
        self._lS, self._lT = float(alpha_prior) * LONG_PRIOR, LONG_PRIOR       # long run
        self.req_decay = req_decay
        self.out_decay = out_decay
        self._pxy = self._pxx = 0.0              # persistence evidence: sums of x y and x x
        self._req_S = 0.0                        # this request's successes / trials so far
        self._req_T = 0.0
        self._copy = False                       # this request copies an earlier output (not alpha evidence)
        self._pos_reach = [0.0] * k_top           # drafting rounds that judged draft j (j = 1..k_top) ...
        self._pos_hold = [0.0] * k_top           # ... and accepted it
        # an engine's output share starts at OUT_FRAC_START, not at the profile's (kept for display):
        # one stream's 1-token outputs halved the next stream's n and sent its k to 1 (docs/controller.md#constants)
        self.out_frac = OUT_FRAC_START
        # trials behind the acceptance estimate (this session's, plus what the profile saw before)
        self.evidence = min(MAX_EVIDENCE, float(profile.alpha_trials or 0.0))
        self.setting = "greedy"                  # the sampling setting acceptance is learned for now
        self._by_setting: dict[str, dict] = {}   # the others' acceptance state, kept while away

    # ------------------------------------------------------------------ acceptance per sampling setting
    ACCEPTANCE_STATE = ("_rS", "_rT", "_lS", "_lT", "_pxy", "_pxx", "_pos_reach", "_pos_hold", "evidence")

    def use_setting(self, key: str, prior: float) -> None:
        """Learn acceptance for sampling setting ``key`` from now on (rakv.decoding.sampling.Sampling.key):
        acceptance falls with temperature, so each setting keeps its own estimates, starting from
        its measured ``prior`` (or what the profile learned at it before); the others are kept."""
        if key == self.setting:
            return
        self._by_setting[self.setting] = {**{a: copy.copy(getattr(self, a)) for a in self.ACCEPTANCE_STATE},
                                          "alpha": dict(vars(self.alpha))}
        st = self._by_setting.pop(key, None) or self._fresh_acceptance(key, prior)
        for a in self.ACCEPTANCE_STATE:
            setattr(self, a, st[a])
        vars(self.alpha).update(st["alpha"])          # the same object the engine and planner hold
        self.setting = key

    def _fresh_acceptance(self, key: str, prior: float) -> dict:
        """A setting's first acceptance state: the profile's learned rate at it, else ``prior``."""
        saved = self.profile.alpha_by_setting.get(key, {}) if key != "greedy" else {
            "alpha_learned": self.profile.alpha_learned, "alpha_trials": self.profile.alpha_trials}
        a = saved.get("alpha_learned")
        a = float(prior if a is None else a)
        k_top = len(self._pos_reach)
        return {"_rS": 0.0, "_rT": 0.0, "_lS": a * LONG_PRIOR, "_lT": LONG_PRIOR, "_pxy": 0.0, "_pxx": 0.0,
                "_pos_reach": [0.0] * k_top, "_pos_hold": [0.0] * k_top,
                "evidence": min(MAX_EVIDENCE, float(saved.get("alpha_trials") or 0.0)),
                "alpha": {"lam": self.alpha.lam, "S": a, "T": 1.0, "rounds": 0}}

    def _save_learned(self) -> None:
        """What this setting's requests taught, into the profile (saved for the next session)."""
        if self.setting == "greedy":
            self.profile.alpha_learned = round(self.alpha_long, 5)
            self.profile.alpha_trials = round(self.evidence, 1)
        else:
            self.profile.alpha_by_setting.setdefault(self.setting, {}).update(
                alpha_learned=round(self.alpha_long, 5), alpha_trials=round(self.evidence, 1))

    # ------------------------------------------------------------------ what a round and a request teach
    def _learn_round(self, drafted: int, accepted: int) -> None:
        """Fold one verified round of ``drafted`` drafts into every acceptance estimate."""
        self._observe_positions(drafted, accepted)
        self.alpha.update(accepted, drafted)
        self._req_S += accepted
        self._req_T += trials(accepted, drafted)
        self.evidence = min(MAX_EVIDENCE, self.evidence + trials(accepted, drafted))

    def _observe_positions(self, drafted: int, accepted: int) -> None:
        """Count the drafts a verify judged by position: 1..accepted accepted, the next one rejected."""
        g = 1.0 - SHAPE_DECAY
        self._pos_reach = [g * x for x in self._pos_reach]
        self._pos_hold = [g * x for x in self._pos_hold]
        for j in range(min(drafted, accepted + 1, len(self._pos_reach))):
            self._pos_reach[j] += 1.0
            self._pos_hold[j] += j < accepted

    @property
    def shape(self) -> list[float]:
        """s_j: acceptance at draft position j over the pooled acceptance of all positions, shrunk
        by SHAPE_PRIOR pseudo-trials: position 1 toward the pooled rate, later ones toward the pooled
        rate of positions 2 and on (no rounds: all 1). A draft that survived one token is in an
        easier stretch, so a position seldom drafted takes the later positions' rate, not the pooled one."""
        reach, hold = sum(self._pos_reach), sum(self._pos_hold)
        if reach <= 0 or hold <= 0:
            return [1.0] * len(self._pos_reach)
        a = hold / reach
        r2, h2 = reach - self._pos_reach[0], hold - self._pos_hold[0]
        a2 = (h2 + SHAPE_PRIOR * a) / (r2 + SHAPE_PRIOR)      # positions 2+, pooled (toward a)
        keep = shape_signal(self._pos_reach, self._pos_hold, a)
        return [1.0 + keep * (((h + SHAPE_PRIOR * (a if j == 0 else a2)) / (r + SHAPE_PRIOR)) / a - 1.0)
                for j, (r, h) in enumerate(zip(self._pos_reach, self._pos_hold))]

    @property
    def alpha_long(self) -> float:
        return self._lS / self._lT

    @property
    def alpha_recent(self) -> float:
        """Recent requests' acceptance: their trials plus PRIOR_TRIALS at the long-run rate."""
        return (self._rS + PRIOR_TRIALS * self.alpha_long) / (self._rT + PRIOR_TRIALS)

    @property
    def persistence(self) -> float:
        """w in [0, 1]: the share of the recent deviation from the long run that the next request
        kept, measured (a deviation that does not persist is noise, and chasing it flips k)."""
        prior = PERSIST_PRIOR * PERSIST_SD ** 2
        return min(1.0, max(0.0, (self._pxy + prior) / (self._pxx + prior)))

    @property
    def alpha_req(self) -> float:
        """Request-level acceptance: the long run plus the measured-persistent part of the recent deviation."""
        a = self.alpha_long
        return a + self.persistence * (self.alpha_recent - a)

    @property
    def alpha_ahead(self) -> float:
        """The acceptance of a request's rounds ahead, as a batch's joint move prices them: the
        request's own trials so far shrunk toward ``alpha_req`` by AHEAD_PRIOR pseudo-trials. Not
        the recent rounds' EWMA (``alpha``): within a request it chases noise and predicts the next
        round worse than this does, and a move that follows it flips K (docs/serve.md)."""
        return (self._req_S + AHEAD_PRIOR * self.alpha_req) / (self._req_T + AHEAD_PRIOR)

    def end_request(self, produced: int, max_new: int, stopped: str) -> None:
        """Fold a finished request into the request-level estimates and the profile."""
        if self._copy:        # its acceptance was known in advance: it says nothing about the next request
            self._req_S = self._req_T = 0.0
            self._copy = False
        if self._req_T >= PERSIST_MIN_TRIALS:      # did the recent deviation carry into this request?
            a = self.alpha_long
            x, y = self.alpha_recent - a, self._req_S / self._req_T - a
            self._pxy = (1 - PERSIST_DECAY) * self._pxy + x * y
            self._pxx = (1 - PERSIST_DECAY) * self._pxx + x * x
        w = self.req_decay
        self.evidence *= 1 - LONG_DECAY      # evidence ages: a regime can change, so probing resumes
        self._rS = (1 - w) * self._rS + w * self._req_S      # no trials: decays toward a_long
        self._rT = (1 - w) * self._rT + w * self._req_T
        if self._req_T > 0:
            g = (1 - 1 / LONG_WINDOW) ** self._req_T      # every trial ages the old ones alike
            self._lS = g * self._lS + self._req_S
            self._lT = g * self._lT + self._req_T
            self._save_learned()
        if stopped in ("eos", "max_new_tokens") and max_new > 1:
            frac = min(1.0, max(0, produced - 1) / (max_new - 1))
            self.out_frac = (1 - self.out_decay) * self.out_frac + self.out_decay * max(frac, 0.02)
            self.profile.out_frac = round(self.out_frac, 5)
        self._req_S = self._req_T = 0.0

    def alpha_sd(self) -> float:
        """alpha's standard error over the evidence (the same count as its optimistic bound's)."""
        a = self.alpha_req
        return math.sqrt(max(a * (1 - a), 0.01) / (self.evidence + PRIOR_TRIALS))

    def alpha_upper(self) -> float:
        """Optimistic acceptance: the estimate plus UCB_Z standard errors over the evidence."""
        a = self.alpha_req
        n = self.evidence + PRIOR_TRIALS
        return min(1.0, a + UCB_Z * math.sqrt(max(a * (1 - a), 0.01) / n))


class OnlineScales:
    """A cost profile's online refinement (a base of ``CostProfile``, whose ``scale``, ``samples``
    and ``V`` it reads and writes): every prediction is base x machine factor (x own, for an own
    term); each measurement moves the machine factor, or a term's own bounded scale."""

    scale: dict
    samples: dict
    V: dict

    def factor(self, term: str) -> float:
        """The online scale of a term: the shared machine factor, times its own for an own term."""
        m = self.scale.get(MACHINE, 1.0)
        return m * _bounded(self.scale.get(term, 1.0)) if self.own_term(term) else m

    def round_own(self, k: int) -> float:
        """The own online scale of a speculative round of k (its drafts and verify together)."""
        return _bounded(self.scale.get(f"R{k}", 1.0)) if k > 0 and self.own_term(f"R{k}") else 1.0

    def observe(self, term: str, predicted: float, measured: float) -> None:
        """Refine the scales from one measurement of ``term`` (``predicted`` with the current
        scales): a term calibrated in the rounds loop moves the machine factor (all terms
        together); an own term (``own_term``) moves its own scale only. Robust: a clipped
        ratio, log-space EWMAs. (When every term moved both, a persistent offset of one term pushed
        the machine factor and the others' own scales to their bounds: docs/controller.md.)"""
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


BATCH_COST_WEIGHT = 0.1     # weight of one shared step in a row count's learned scale (log space)
BATCH_COST_CLIP = 2.0       # one step moves that scale by at most this factor
BATCH_COST_BOUND = 4.0      # a learned scale stays within this factor of the profile's W(n)


MOVE_EVERY = 4              # shared steps a joint move is kept for (its requests the same; docs/serve.md)
EXACT_ROWS = 16             # row counts up to this learn a scale each (docs/serve.md: why)


def rows_bucket(n: int) -> int:
    """The row counts that share a learned scale: each count up to EXACT_ROWS (a pass's cost per
    row changes fast there, where the kernel streams the codes once for a few rows and again past
    them), then 17-31, 32-63, ... (keyed -bit_length)."""
    n = max(1, int(n))
    return n if n <= EXACT_ROWS else -n.bit_length()


def _bucket_at(b: int) -> float:
    """Where bucket b's scale sits on log2(rows) (a count's own, a range's middle): scales are
    interpolated between buckets, so W(n) has no step at a bucket's edge for the k that crosses it
    to exploit."""
    if b > 0:
        return math.log2(b)
    b = -b
    return math.log2((2 ** (b - 1) + 2 ** b - 1) / 2)


class BatchCosts:
    """W(n) as the batch's shared steps measured it: per count (or range) of total rows (``rows_bucket``), the
    measured ms of the target's pass over the profile's W(n) (a verify of n - 1 drafts, measured for
    one request) as a clipped log-space EWMA. Several requests' rows in one pass cost what one
    request's n rows do not (each attends to its own cache, the lanes' own Python), so the batch's
    price follows the real steps. Between measured buckets the scale is interpolated; past them
    the nearest one's holds."""

    def __init__(self):
        self.scale: dict[int, float] = {}
        self.steps: dict[int, int] = {}
        self._seen: dict[int, float] = {}       # factor(rows) since the last measurement (asked many times a step)

    def observe(self, rows: int, predicted_ms: float, measured_ms: float) -> None:
        if rows < 1 or predicted_ms <= 0 or measured_ms <= 0 or not math.isfinite(measured_ms):
            return
        b = rows_bucket(rows)
        n = self.steps.get(b, 0)
        base = self.scale.get(b) or self.factor(rows)
        r = min(BATCH_COST_CLIP, max(1.0 / BATCH_COST_CLIP, measured_ms / (predicted_ms * base)))
        w = 1.0 / (n + 1) if n < 1.0 / BATCH_COST_WEIGHT else BATCH_COST_WEIGHT
        self.scale[b] = min(BATCH_COST_BOUND, max(1.0 / BATCH_COST_BOUND, base * r ** w))
        self.steps[b] = n + 1
        self._seen.clear()

    def factor(self, rows: int) -> float:
        """The learned scale of a pass of ``rows`` rows (1.0 before any shared step): its bucket's,
        interpolated on log2(rows) between the measured buckets, the end ones' beyond them."""
        if not self.scale:
            return 1.0
        f = self._seen.get(rows)
        if f is None:
            f = self._seen[rows] = self._interpolated(rows)
        return f

    def _interpolated(self, rows: int) -> float:
        x = math.log2(max(1, rows))
        pts = sorted((_bucket_at(b), s) for b, s in self.scale.items())
        if x <= pts[0][0]:
            return pts[0][1]
        for (x0, s0), (x1, s1) in zip(pts, pts[1:]):
            if x <= x1:
                return s0 + (s1 - s0) * (x - x0) / (x1 - x0)
        return pts[-1][1]


class BatchView:
    """What each request of a batch put in its latest step: rows fed and tokens emitted (one view
    for the lanes of a ``rakv.engine.batch.LanePool``), and what the shared steps cost (``costs``).
    A request's k is priced against the others'."""

    def __init__(self, lockstep: bool = False):
        self.rows: dict[int, int] = {}
        self.tokens: dict[int, float] = {}
        self.drafted: dict[int, int] = {}       # model-drafted tokens of each one's latest round
        self.alpha: dict[int, float] = {}       # acceptance of each request whose k is the batch's joint move
        self.sunk: dict[int, float] = {}        # ... its draft's catch-up, ms per token left
        self.steps = 0                          # shared steps so far (``tick``)
        self.members = 0                        # changes of the joint move's requests so far (one joins or leaves)
        self.move: tuple | None = None          # ((step, members), K, drafting requests): the joint move
        self.costs = BatchCosts()
        self.lockstep = lockstep                # the steps run a draft's passes first (engine.batch.lockstep)

    def join(self, rid: int) -> None:
        """A request starts: until its first round it counts as one plain row a step (what it will
        feed, its prompt aside), so requests that start together price their first k by each other."""
        self.rows.setdefault(rid, 1)
        self.tokens.setdefault(rid, 1.0)

    def told(self, rid: int, rows: int, tokens: float, drafted: int = 0) -> None:
        self.rows[rid], self.tokens[rid] = int(rows), float(tokens)
        self.drafted[rid] = int(drafted)

    def joins(self, rid: int, alpha: float, sunk: float = 0.0) -> None:
        """A request whose k is priced as part of the batch's joint move (``policy.joint_move``), at
        acceptance alpha, its draft's catch-up ``sunk`` ms per token it has left (told again as it
        learns)."""
        if rid not in self.alpha:
            self.members += 1
        self.alpha[rid] = float(alpha)
        self.sunk[rid] = float(sunk)

    def tick(self) -> None:
        """A shared step ran (``move_due`` counts them)."""
        self.steps += 1

    def move_due(self, ahead: int = 0) -> bool:
        """Is the joint move (made again every MOVE_EVERY shared steps, and as soon as a request
        of it joins or leaves) to be made at the round that asks ``ahead`` steps from now?"""
        m = self.move
        return m is None or m[0][1] != self.members or self.steps + ahead - m[0][0] >= MOVE_EVERY

    def leave(self, rid: int) -> None:
        if rid in self.alpha:
            self.members += 1
        self.rows.pop(rid, None)
        self.tokens.pop(rid, None)
        self.drafted.pop(rid, None)
        self.alpha.pop(rid, None)
        self.sunk.pop(rid, None)

    def apart(self, rid: int | None) -> tuple[int, float]:
        """(rows, tokens) of the other requests not in the joint move (``joins``), as they are."""
        ids = [q for q in self.rows if q != rid and q not in self.alpha]
        return sum(self.rows[q] for q in ids), sum(self.tokens[q] for q in ids)

    def others_drafting(self, rid: int) -> int:
        """The most tokens another request's latest round drafted with the model (in lockstep, the
        draft passes every round of the batch waits for)."""
        return max((n for q, n in self.drafted.items() if q != rid), default=0)

    def others(self, rid: int) -> tuple[int, float, int]:
        """(rows, tokens, requests) of the batch's other requests in their latest steps."""
        ids = [q for q in self.rows if q != rid]
        return sum(self.rows[q] for q in ids), sum(self.tokens[q] for q in ids), len(ids)

